"""The bytes `engine_bytes` gives for the engine's pieces against what the engine allocates for them on fake CUDA
(`kvrescue_testkit.fake_cuda.MemoryLog`, by the engine module that allocated them)."""

from itertools import accumulate

import pytest
import torch

from kvrescue import engine_bytes
from kvrescue.detect import DetectorConfig
from kvrescue.engine import flex
from kvrescue.engine.steps import StepDecoder, StepRules
from kvrescue.sampling_params import SamplingParams
from kvrescue_testkit.fake_cuda import FakeCuda
from kvrescue_testkit.random_checkpoints import build_tokenizer


def allocated_by(cuda: FakeCuda, part: str, make) -> tuple[object, int]:
    """What `make()` returns, and the bytes the engine module `part` allocated for it that are still alive."""
    before = cuda.memory.live["cuda:0", part]
    made = make()
    return made, cuda.memory.live["cuda:0", part] - before


@pytest.mark.parametrize("tokens", [1, 32])
@pytest.mark.parametrize("rows, pool_blocks, width", [(1, 8, 3), (5, 40, 6), (64, 300, 20), (100, 1000, 64)])
def test_flexattentions_block_mask_over_a_full_cache_is_what_the_plan_counts(rows, pool_blocks, width, tokens):
    """`flex.paged_mask` of a one-token step or a forward of 32 tokens a row: the arrays its block mask keeps while the
    step reads it."""
    with FakeCuda() as cuda:
        table = torch.randint(0, pool_blocks, (rows, width), device="cuda:0")
        cached = torch.randint(0, width * 16, (rows,), device="cuda:0")
        mask, kept = allocated_by(cuda, "engine.flex",
                                  lambda: flex.paged_mask(table, cached, pool_blocks, 16, 7, tokens))
        assert kept == engine_bytes.paged_mask_bytes(rows, pool_blocks)
        del mask


@pytest.mark.parametrize("starts, detector, fixed_length, static", [
    ([12], True, None, False), ([64], False, None, False), ([65], True, 8, False), ([200], False, 40, False),
    ([40, 60], True, None, False), ([64], True, None, True), ([63], False, None, True)])
def test_a_runners_step_lanes_are_what_the_plan_counts(starts, detector, fixed_length, static):
    """`StepDecoder.start` of `starts` candidates in turn (none finished): its lanes (a power of two, at least 64)
    hold each candidate's draws table (fp32, one a column: max_step_tokens, or a synthetic step's length) and the
    detector's state; in static shapes (sampling in CUDA graphs) one lane more, the padding's scratch lane."""
    rows = sum(starts) + static
    detect = DetectorConfig() if detector else None
    rules = StepRules(frozenset(), SamplingParams(), max_step_tokens=24, fixed_length=fixed_length, detector=detect)
    with FakeCuda() as cuda:
        decoder = StepDecoder(torch.device("cuda:0"), build_tokenizer(), rules, static=static, graphs=static)
        def start_all() -> None:
            for first, count in zip(accumulate(starts, initial=0), starts):
                block = list(range(first, first + count))
                decoder.start(block, block, [5] * count, [detector] * count)

        _, kept = allocated_by(cuda, "engine.steps", start_all)
    columns = min(24, fixed_length or 24)
    window = detect.ent_window if detect else 1
    assert kept == engine_bytes.step_lanes_bytes(rows, columns, window)
