"""The CUDA caching allocator model on sequences whose outcome follows from the allocator's documented rules (no
torch: oomtune/memory/allocator.py)."""

import pytest

from oomtune.memory.allocator import CachingAllocatorModel, OutOfMemory, round_size, segment_size

KiB, MiB = 1 << 10, 1 << 20


def test_sizes_round_to_512_bytes_and_segments_follow_the_request_size():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert segment_size(512) == segment_size(1 * MiB) == 2 * MiB  # the small pool's segments
    assert segment_size(1 * MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB  # large, under 10 MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB) == 12 * MiB  # rounded to 2 MiB


def test_small_requests_share_2_mib_segments():
    a = CachingAllocatorModel()
    a.malloc("x", 100)
    assert (a.allocated_bytes, a.reserved_bytes) == (512, 2 * MiB)
    for i in range(4):  # 1 MiB each: two per segment (the first segment still holds x's 512 bytes)
        a.malloc(i, 1 * MiB)
    assert a.reserved_bytes == 3 * 2 * MiB  # x + 1 MiB in the first; 1 + 1 in the second; 1 in the third
    assert len(a.segments) == 3


def test_a_large_segment_is_split_and_its_rest_serves_the_next_request():
    a = CachingAllocatorModel()
    a.malloc("a", 5 * MiB)  # a 20 MiB segment; the 15 MiB rest stays cached
    a.malloc("b", 5 * MiB)  # from that rest
    assert (a.reserved_bytes, len(a.segments)) == (20 * MiB, 1)
    a.malloc("c", 12 * MiB)  # the cached 10 MiB rest is too small: a new 12 MiB segment
    assert (a.reserved_bytes, a.allocated_bytes) == (32 * MiB, 22 * MiB)


def test_a_rest_of_1_mib_or_less_is_not_split_off_a_large_block():
    a = CachingAllocatorModel()
    a.malloc("a", 12 * MiB)  # a 12 MiB segment, all of it handed out
    a.free("a")
    a.malloc("b", 11 * MiB)  # the cached 12 MiB block: its 1 MiB rest is not split off
    assert (a.allocated_bytes, a.reserved_bytes) == (12 * MiB, 12 * MiB)


def test_blocks_never_merge_across_segments_so_freeing_can_double_the_reserved_memory():
    """Two 12 MiB tensors in two segments, both freed: 24 MiB is cached, but in two pieces. A 24 MiB request fits
    neither and reserves a third segment: 48 MiB reserved for a 24 MiB tensor peak."""
    a = CachingAllocatorModel()
    a.malloc("a", 12 * MiB)
    a.malloc("b", 12 * MiB)
    a.free("a")
    a.free("b")
    a.malloc("c", 24 * MiB)
    assert a.peak_allocated_bytes == 24 * MiB
    assert a.reserved_bytes == a.peak_reserved_bytes == 48 * MiB


def test_free_neighbours_in_one_segment_merge_back():
    a = CachingAllocatorModel()
    a.malloc("a", 5 * MiB)
    a.malloc("b", 5 * MiB)  # a | b | 10 MiB free, one 20 MiB segment
    a.free("a")
    a.free("b")  # merges with a's block and with the free rest: one 20 MiB free block again
    a.malloc("c", 18 * MiB)
    assert (a.reserved_bytes, len(a.segments)) == (20 * MiB, 1)


def test_best_fit_takes_the_smallest_cached_block_that_holds_the_request():
    a = CachingAllocatorModel()
    for name, size in (("big", 16 * MiB), ("mid", 12 * MiB), ("pin", 100)):
        a.malloc(name, size)
    a.free("big")
    a.free("mid")
    a.malloc("x", 11 * MiB)  # the 12 MiB block, not the 16 MiB one (no split: the rest is 1 MiB)
    a.malloc("y", 15 * MiB)  # the 16 MiB block still serves this
    assert a.reserved_bytes == 16 * MiB + 12 * MiB + 2 * MiB


def test_at_capacity_the_cached_free_segments_are_given_back_before_running_out():
    a = CachingAllocatorModel(capacity_bytes=40 * MiB)
    a.malloc("a", 12 * MiB)
    a.malloc("b", 12 * MiB)
    a.free("a")
    a.free("b")  # 24 MiB reserved, none of it in use
    a.malloc("c", 24 * MiB)  # 24 + 24 > 40: both free segments go back first
    assert (a.reserved_bytes, a.peak_reserved_bytes) == (24 * MiB, 24 * MiB)
    a.malloc("d", 12 * MiB)  # 24 + 12 <= 40
    with pytest.raises(OutOfMemory):
        a.malloc("e", 6 * MiB)  # a 20 MiB segment: 56 > 40, and nothing cached is free
    a.free("d")
    a.empty_cache()
    assert a.reserved_bytes == 24 * MiB


def test_a_resize_takes_the_new_block_before_it_frees_the_old_one():
    a = CachingAllocatorModel()
    a.malloc("w", 12 * MiB)  # a 12 MiB segment, all of it used
    a.resize("w", 14 * MiB)  # the copy needs both: a 14 MiB segment while the 12 MiB one still holds the data
    assert (a.allocated_bytes, a.reserved_bytes, a.peak_allocated_bytes) == (14 * MiB, 26 * MiB, 26 * MiB)
    a.resize("w", 0)  # FSDP frees a gathered parameter this way
    a.resize("w", 12 * MiB)  # and gathers it again: the cached 12 MiB segment serves it
    assert (a.allocated_bytes, a.reserved_bytes) == (12 * MiB, 26 * MiB)


def test_zero_bytes_and_unknown_keys_change_nothing():
    a = CachingAllocatorModel()
    a.malloc("empty", 0)
    a.free("empty")
    a.free("never")
    assert (a.reserved_bytes, a.allocated_bytes) == (0, 0)


def test_the_simulated_devices_replay_a_measurements_storages_through_the_model():
    """device: cpu. The doubling sequence above with real tensors: the tracker feeds the model each storage's birth
    and death, in order."""
    import torch

    from oomtune.memory.devices import CpuDevice

    device = CpuDevice("1GiB")
    with device.measure() as reading:
        a = torch.empty(12 * MiB, dtype=torch.uint8)
        b = torch.empty(12 * MiB, dtype=torch.uint8)
        del a, b
        c = torch.empty(24 * MiB, dtype=torch.uint8)
        del c
    assert reading.peak_allocated_bytes == 24 * MiB
    assert reading.modelled_reserved_bytes == 48 * MiB


def test_a_trial_reserves_the_same_on_the_cpu_and_the_fake_device_and_at_least_its_tensor_peak():
    """device: cpu and fake. The same storages in the same order: the model's reserved peak agrees to the byte, and
    it is never under the tensor peak."""
    from oomtune.config.schema import Plan
    from oomtune.memory.devices import CpuDevice, FakeDevice
    from oomtune.memory.margin import Margin
    from oomtune.model_file import load_model_file
    from oomtune.search.trial import run_trial

    from ..conftest import EXAMPLES

    model_file = load_model_file(EXAMPLES / "tiny_gpt.py")
    for plan in (Plan(4, 64, "fp32"), Plan(4, 64, "bf16", activation_checkpointing=True, grad_accum_steps=2)):
        cpu = run_trial(model_file, plan, CpuDevice("1GiB"))
        fake = run_trial(model_file, plan, FakeDevice("1GiB", margin=Margin()))
        assert cpu.modelled_reserved_bytes == fake.modelled_reserved_bytes >= cpu.peak_allocated_bytes
        print(f"{plan.describe()}: tensors {cpu.peak_allocated_bytes}, modelled reserved "
              f"{cpu.modelled_reserved_bytes} ({cpu.modelled_reserved_bytes / cpu.peak_allocated_bytes - 1:+.1%})")
