"""Per-track worker arguments are checked with the worker's own ``serve`` parser before they reach a process."""

import pytest

from apps.fleet.worker_args import (
    FAULT_OPTIONS,
    OPERATOR_OPTIONS,
    InvalidWorkerArgs,
    _parser,
    parse_worker_args,
)


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


def _valued_options() -> list[str]:
    """Every operator-settable and fault option that takes a value (flags excluded)."""
    actions = {option: action for action in _parser()._actions for option in action.option_strings}
    return [option for option in (*OPERATOR_OPTIONS, *FAULT_OPTIONS) if actions[option].nargs != 0]


@pytest.mark.parametrize("option", _valued_options())
def test_every_settable_option_refuses_a_nonsense_value_when_entered(option):
    # A value the worker cannot use must be refused here, never by a worker process that fails to start
    # (``--dtype bogus`` was accepted and only failed in the worker's model loader).
    with pytest.raises(InvalidWorkerArgs) as info:
        parse_worker_args(f"{option} bogus")
    assert option in str(info.value)
