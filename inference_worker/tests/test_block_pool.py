"""Block pool: free queue order, reference counts, the null block, and the torch-free rule."""

import subprocess
import sys
from pathlib import Path

import pytest

from inference_worker.engine.block_pool import NULL_BLOCK_ID, BlockPool


def test_null_block_is_never_allocated_or_counted_free():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4
    assert pool.get_num_free_blocks() == 4
    taken = pool.allocate(4)
    assert [b.block_id for b in taken] == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 0
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError, match="cannot allocate 1 blocks: 0 free"):
        pool.allocate(1)
    pool.free([pool.null_block])  # ignored
    assert pool.get_num_free_blocks() == 0
    assert pool.null_block.block_id == NULL_BLOCK_ID and pool.null_block.ref_cnt == 0


def test_freed_blocks_go_to_the_tail_and_are_reused_last():
    pool = BlockPool(6)
    a = pool.allocate(3)  # 1, 2, 3
    pool.free([a[2], a[0]])  # tail gets 3 then 1
    assert [b.block_id for b in pool.allocate(4)] == [4, 5, 3, 1]


def test_ref_counts_share_and_double_free_raises():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.touch([block, pool.null_block])
    assert block.ref_cnt == 2 and pool.null_block.ref_cnt == 0
    pool.free([block])
    assert pool.get_num_free_blocks() == 2
    pool.free([block])
    assert pool.get_num_free_blocks() == 3
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([block])
    pool.touch([block])  # re-take a free block by sharing
    assert pool.get_num_free_blocks() == 2 and block.ref_cnt == 1


@pytest.mark.parametrize("num_blocks", [0, 1, 2.5])
def test_pool_needs_a_usable_block(num_blocks):
    with pytest.raises(ValueError, match="num_blocks must be an int >= 2"):
        BlockPool(num_blocks)


def test_engine_core_modules_never_import_torch():
    code = (
        "import sys\n"
        "import inference_worker.engine.block_pool, inference_worker.engine.kv_cache_manager\n"
        "import inference_worker.engine.request, inference_worker.engine.sched_output\n"
        "import inference_worker.engine.scheduler, inference_worker.engine.kv_cache_sizing\n"
        "print('torch' in sys.modules)\n"
    )
    repo_root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo_root)
    assert result.stdout.strip() == "False"
