"""FakeTensorMode's dispatch-cache key, the same key in fewer Python calls (`fast_cache_keys`).

Every op a fake trial runs is answered from FakeTensorMode's dispatch cache (GPT-2 small's ladder: all but none a
miss), keyed by the op and each tensor argument's metadata: `extract_tensor_metadata` reads it (its memory format
through `suggest_memory_format`, sparsity four times over) and `TensorMetadata._flatten_into` lays it into the key,
each field looked up through `dataclasses.fields` and each size and stride through the nine type tests of
`_prep_args_for_hash`. That is a sixth of a trace's time. For a strided tensor whose sizes and strides are plain
ints (every tensor of a trial here), `_extract` and `_flatten_into` below give the same metadata and lay out the
same key, element for element; anything else (sparse, symbolic sizes) goes to torch's own.

Torch's internals, so: used only where the fields are the ones these copy (`TensorMetadata`'s, in order) and, once
a process, where both give torch's own result on tensors of every kind they take (`_agrees`); else torch's code runs
as it is. Inside `fast_cache_keys` only (the fake device's stretches of work: fakes.real_code_paths)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch._subclasses import fake_tensor
from torch.utils._python_dispatch import _disable_current_modes

FIELDS = ("dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset", "storage_bytes",
          "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference", "is_sparse", "is_coalesced",
          "dense_dim", "sparse_dim")
_ORDER = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}  # channels_last's and channels_last_3d's dims, innermost first
_LENGTHS = tuple(f"length_{n}" for n in range(9))
_STRIDED = torch.strided
_CHECKED: list[bool] = []  # (once a process: whether the two agree with torch's)


def _channels_last(shape: torch.Size, strides: tuple) -> bool:
    """prims_common.are_strides_like_channels_last_or_false, on ints."""
    order = _ORDER.get(len(shape))
    if order is None or strides[1] == 0:
        return False
    least = 0
    for d in order:
        if shape[d] == 0 or strides[d] < least or (d == 0 and least == strides[1]):
            return False
        least = strides[d] * shape[d]
    return True


def _extract(t: torch.Tensor):
    """extract_tensor_metadata(t), for a strided tensor with plain sizes (else torch's own)."""
    if t.layout is not _STRIDED or t._has_symbolic_sizes_strides:
        return _ORIGINAL_EXTRACT(t)
    shape, stride = t.shape, t.stride()
    fmt = (torch.channels_last if len(shape) == 4 else torch.channels_last_3d) if _channels_last(shape, stride) \
        else torch.contiguous_format
    if not t.is_contiguous(memory_format=fmt):
        fmt = None
    return fake_tensor.TensorMetadata(t.dtype, shape, stride, t.device, _STRIDED, fmt, t.storage_offset(),
                                      t.untyped_storage().nbytes(), t.requires_grad, t.is_quantized, t.is_conj(),
                                      t.is_neg(), t.is_inference(), False, None, None, None)


def _flatten_into(self, result: list, mode, state) -> None:
    """TensorMetadata._flatten_into, where the sizes, strides, offset and bytes are ints (else torch's own)."""
    shape, stride, offset, nbytes = self.shape, self.stride, self.storage_offset, self.storage_bytes
    if (len(shape) >= len(_LENGTHS) or len(stride) >= len(_LENGTHS) or type(offset) is not int
            or (nbytes is not None and type(nbytes) is not int) or any(type(x) is not int for x in shape)
            or any(type(x) is not int for x in stride)):
        _ORIGINAL_FLATTEN(self, result, mode, state)
        return
    append = result.append
    append(self.dtype)
    for sizes in (shape, stride):
        append(type(sizes))
        append(_LENGTHS[len(sizes)])
        for x in sizes:
            append(int)
            append(x)
    result.extend((self.device, self.layout, self.memory_format, offset, nbytes, self.requires_grad,
                   self.is_quantized, self.is_conj, self.is_neg, self.is_inference, self.is_sparse,
                   self.is_coalesced, self.dense_dim, self.sparse_dim))


_ORIGINAL_EXTRACT = fake_tensor.extract_tensor_metadata
_ORIGINAL_FLATTEN = fake_tensor.TensorMetadata._flatten_into


def _samples() -> list[torch.Tensor]:
    """Tensors of every kind the two take: contiguous, transposed, channels-last (2d, 3d), a view at an offset, 0-d,
    empty, with a gradient, bf16, int."""
    base = torch.empty(2, 3, 4, 5)
    return [base, base.transpose(1, 2), base.to(memory_format=torch.channels_last),
            torch.empty(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d), base[1, 1:], torch.empty(()),
            torch.empty(0, 3), torch.empty(3, 4, requires_grad=True), torch.empty(8, dtype=torch.bfloat16),
            torch.empty(2, 1, 1, 4).as_strided((2, 1, 1, 4), (4, 4, 4, 1)), torch.zeros(5, dtype=torch.long)]


def _agrees() -> bool:
    """The fields are those copied, and on every sample, the metadata and the key laid out are torch's own."""
    if tuple(f.name for f in dataclasses.fields(fake_tensor.TensorMetadata)) != FIELDS:
        return False
    with _disable_current_modes():  # (outside the trial's modes: its tracker counts none of these)
        samples = _samples()
        mode = fake_tensor.FakeTensorMode()
        state = fake_tensor._CacheKeyState(mode.shape_env)
        fakes = [mode.from_tensor(t) for t in samples]
    return all(_agrees_on(fake, mode, state) for fake in fakes)


def _agrees_on(fake: torch.Tensor, mode, state) -> bool:
    ours, theirs = _extract(fake), _ORIGINAL_EXTRACT(fake)
    if ours != theirs:
        return False
    mine, torchs = [], []
    _flatten_into(ours, mine, mode, state)
    _ORIGINAL_FLATTEN(theirs, torchs, mode, state)
    return mine == torchs and [type(x) for x in mine] == [type(x) for x in torchs]


@contextlib.contextmanager
def fast_cache_keys() -> Iterator[None]:
    """Inside, FakeTensorMode's cache keys are laid out by `_extract` and `_flatten_into` (where they agree with
    torch's: _agrees, checked once a process)."""
    if not _CHECKED:
        try:
            _CHECKED.append(_agrees())
        except Exception:  # noqa: BLE001 - torch's internals are not what these copy: torch's own then
            _CHECKED.append(False)
    if not _CHECKED[0] or fake_tensor.extract_tensor_metadata is not _ORIGINAL_EXTRACT:  # (nested: as it is)
        yield
        return
    fake_tensor.extract_tensor_metadata = _extract
    fake_tensor.TensorMetadata._flatten_into = _flatten_into
    try:
        yield
    finally:
        fake_tensor.extract_tensor_metadata = _ORIGINAL_EXTRACT
        fake_tensor.TensorMetadata._flatten_into = _ORIGINAL_FLATTEN
