"""Per-track worker arguments are checked with the worker's own ``serve`` parser before they reach a process."""

import pytest

from apps.fleet.worker_args import InvalidWorkerArgs, parse_worker_args


@pytest.mark.parametrize(
    ("line", "args"),
    [
        ("", ()),
        ("   ", ()),
        ("--fault-error-rate 0.5", ("--fault-error-rate", "0.5")),
        ("--fault-error-rate=1 --fault-seed 7", ("--fault-error-rate=1", "--fault-seed", "7")),
        ("--max-num-seqs 2 --kv-cache-memory 64MiB", ("--max-num-seqs", "2", "--kv-cache-memory", "64MiB")),
        ("--log-level 'warning'", ("--log-level", "warning")),
    ],
)
def test_valid_serve_options_split_like_a_shell_line(line, args):
    assert parse_worker_args(line) == args


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--fault-error-rate 1.5", "--fault-error-rate must be in [0, 1], got 1.5"),
        ("--fault-error-rate nan", "--fault-error-rate must be in [0, 1], got nan"),
        ("--fault-error-rate half", "argument --fault-error-rate: invalid float value: 'half'"),
        ("--fault-err 0.5", "unrecognized arguments: --fault-err 0.5"),  # abbreviations are refused
        ("--max-num-seqs 0", "--max-num-seqs must be >= 1, got 0"),
        ("--kv-cache-memory lots", "cannot parse --kv-cache-memory 'lots'"),
        ("--log-level loud", "argument --log-level: invalid choice: 'loud'"),
        ("canary", "unrecognized arguments: canary"),
        ("-h", "unrecognized arguments: -h"),
        ('--log-level "info', "like a shell line: No closing quotation"),
        ("--track canary", "--track is set by Ferry from the pool, track and model version"),
        ("--port=9000", "--port is set by Ferry"),
        ("--model other", "--model is set by Ferry"),
        ("--drain-timeout 5", "--drain-timeout is set by Ferry"),
        ("--max-num-seqs " + "1" * 500, "at most 500"),
    ],
)
def test_invalid_options_are_refused_with_the_option_named(line, message):
    with pytest.raises(InvalidWorkerArgs) as info:
        parse_worker_args(line)
    assert message in str(info.value)


def test_non_string_is_refused():
    with pytest.raises(InvalidWorkerArgs, match="must be a string of serve options, got list"):
        parse_worker_args(["--max-num-seqs", "2"])
