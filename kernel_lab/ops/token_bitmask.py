"""Project 06: a grammar's token bitmask applied to a batch of logits, in place.

    logits[rows[i], j] = -inf   wherever bit j of bitmask[i] is 0          (else logits are left untouched)

The bitmask layout is xgrammar's (`xgrammar.allocate_token_bitmask`): int32 words, token j is bit j % 32 of
word j // 32, 1 = allowed; a row has ceil(vocab / 32) words and the bits past the vocabulary in the last word
are ignored. `rows` (an int32/int64 tensor, one logits row number per bitmask row) lets a batch mix rows with
a grammar and rows without one: only the structured rows need a bitmask row. Without `rows`, bitmask row i
masks logits row i. The same logits row may appear twice (the masks are then combined: allowed by both).

Only disallowed entries are written and the logits are never read, so allowed values keep their exact bits
(NaN included) and duplicate rows cannot race. Memory traffic, design and tests: projects/06_topk_sampling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cpu_kernels
from .common import FLOAT_DTYPES, check_last_dim_contiguous, check_same_device, check_tensor, use_triton

WORDS_PER_PROGRAM = 64  # 2048 tokens per program: 8 KiB of fp32 logits, 256 B of mask


def bitmask_words(vocab_size: int) -> int:
    """Words per bitmask row: ceil(vocab_size / 32), as xgrammar's `get_bitmask_shape`."""
    return (vocab_size + 31) // 32


def bytes_moved(masked_rows: int, vocab: int, element_size: int, row_index_size: int = 0) -> int:
    """DRAM bytes one `apply_token_bitmask` call moves: each mask row read once (4 bytes a word), its row
    number when `rows` is given (`row_index_size` bytes: 8 for int64), and one pass of writes over each
    masked logits row. The kernel never reads the logits and stores only the disallowed elements, but a
    partly written 32-byte sector costs a whole sector of DRAM traffic, so with any mixed mask the write
    pass is the whole row (an all-allowed row is written not at all, which this does not model)."""
    return masked_rows * (bitmask_words(vocab) * 4 + row_index_size + vocab * element_size)


def allocate_token_bitmask(rows: int, vocab_size: int, device="cpu") -> torch.Tensor:
    """A [rows, ceil(vocab_size / 32)] int32 bitmask with every token allowed (all bits set, i.e. -1)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, device=device)


# --------------------------------------------------------------------------------------------- reference
def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor,
                                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """The specification, in torch ops: unpack the bits, then fill the disallowed logits with -inf."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    targets = torch.arange(bitmask.shape[0], device=logits.device) if rows is None else rows.long()
    for i, r in enumerate(targets.tolist()):  # row by row: duplicates combine, a strided row is written in place
        logits[r].masked_fill_(~allowed[i], float("-inf"))
    return logits


# --------------------------------------------------------------------------------------------- kernel
@triton.jit
def _token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, row_stride, col_stride, mask_stride,
                          WORDS: tl.constexpr, HAS_ROWS: tl.constexpr):
    # grid (bitmask rows, ceil(words / WORDS)): a [WORDS, 32] tile of tokens per program, one mask word
    # per tile row, broadcast against the 32 bit positions.
    mask_row = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + mask_row).to(tl.int64)
    else:
        row = mask_row
    words_at = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    n_words = (vocab + 31) // 32
    # Words past the row read as "all allowed", so nothing is written there.
    word = tl.load(bitmask_ptr + mask_row * mask_stride + words_at, mask=words_at < n_words, other=-1)
    bit = tl.arange(0, 32)
    token = words_at[:, None] * 32 + bit[None, :]
    disallowed = ((word[:, None] >> bit[None, :]) & 1) == 0
    neg_inf = tl.full([WORDS, 32], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * row_stride + token.to(tl.int64) * col_stride, neg_inf,
             mask=disallowed & (token < vocab))


def _launch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    n_masks, words = bitmask.shape
    if n_masks == 0 or logits.shape[1] == 0:
        return
    grid = (n_masks, triton.cdiv(words, WORDS_PER_PROGRAM))
    _token_bitmask_kernel[grid](logits, bitmask, rows if rows is not None else bitmask, logits.shape[1],
                                logits.stride(0), logits.stride(1), bitmask.stride(0),
                                WORDS=WORDS_PER_PROGRAM, HAS_ROWS=rows is not None, num_warps=4)


# --------------------------------------------------------------------------------------------- public op
def _validate(logits, bitmask, rows) -> None:
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("bitmask", bitmask, dtypes=(torch.int32,), ndim=2)
    words = bitmask_words(logits.shape[1])
    if bitmask.shape[1] != words:
        raise ValueError(f"bitmask must have ceil(vocab / 32) = {words} int32 words per row for a vocabulary of "
                         f"{logits.shape[1]}, got shape {tuple(bitmask.shape)}")
    check_last_dim_contiguous("bitmask", bitmask)
    if rows is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(f"without rows, bitmask must have one row per logits row ({logits.shape[0]}), "
                             f"got {bitmask.shape[0]}")
    else:
        check_tensor("rows", rows, dtypes=(torch.int32, torch.int64), ndim=1)
        if rows.shape[0] != bitmask.shape[0]:
            raise ValueError(f"rows must hold one logits row number per bitmask row ({bitmask.shape[0]}), "
                             f"got shape {tuple(rows.shape)}")
    check_same_device(logits=logits, bitmask=bitmask, rows=rows)


def _check_row_values(rows: torch.Tensor, batch: int) -> None:
    if rows.numel() and not bool(((rows >= 0) & (rows < batch)).all()):
        bad = rows[(rows < 0) | (rows >= batch)][0].item()
        raise ValueError(f"rows must be logits row numbers in [0, {batch}), got {bad}")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None,
                        validate: bool | None = None) -> torch.Tensor:
    """Set logits[rows[i], j] = -inf wherever bit j of bitmask[i] is 0, in place; returns `logits`.

    logits: [batch, vocab] fp32/fp16/bf16, any strides. bitmask: [n, ceil(vocab / 32)] int32, unit stride in
    its last dimension. rows: None (n == batch, row i masks row i) or [n] int32/int64 row numbers.
    `validate` reads `rows` back to check its range: always on CPU, on CUDA only when asked (it syncs)."""
    _validate(logits, bitmask, rows)
    if rows is not None and (validate or (validate is None and not rows.is_cuda)):
        _check_row_values(rows, logits.shape[0])
    if use_triton(logits):
        _launch(logits, bitmask, rows)
    elif not cpu_kernels.apply_token_bitmask_cpu(logits, bitmask, rows):
        apply_token_bitmask_reference(logits, bitmask, rows)
    return logits


# --------------------------------------------------------------------------------------------- AOT specs
def compile_specs():
    """Specialisations compiled for sm_80/89/90 by the compile tests and tools/inspect_triton.py."""
    from kernel_lab.harness.compile import CompileSpec

    specs = []
    for dtype, ty in (("bf16", "*bf16"), ("fp16", "*fp16"), ("fp32", "*fp32")):
        for has_rows in (False, True):
            sig = {"logits_ptr": ty, "bitmask_ptr": "*i32", "rows_ptr": "*i64", "vocab": "i32",
                   "row_stride": "i32", "col_stride": "constexpr", "mask_stride": "i32"}
            specs.append(CompileSpec(
                name=f"token_bitmask_{dtype}" + ("_rows" if has_rows else ""), kernel=_token_bitmask_kernel,
                signature=sig, constexprs={"col_stride": 1, "WORDS": WORDS_PER_PROGRAM, "HAS_ROWS": has_rows},
                num_warps=4, aligned=("logits_ptr", "bitmask_ptr", "row_stride", "mask_stride"),
            ))
    return specs
