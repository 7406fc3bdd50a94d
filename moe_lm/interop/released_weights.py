"""A released checkpoint's weights as the analysis dtype, a tensor at a time: bf16/fp16/fp32 shards cast, and
DeepSeek's FP8 release format dequantised by DeepSeek's own rule.

The FP8 format (DeepSeek-V3, R1, V3.1 and Kimi-K2, all DeepseekV3; Qwen3's official -FP8 releases use the same
fine-grained format): config.json's `quantization_config` is `{"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], ...}`; a quantised matrix `W` (M x N) is stored as float8_e4m3fn with a float
`W_scale_inv` (the name with `_scale_inv` appended) of shape [ceil(M / 128), ceil(N / 128)], one scale per block,
the blocks on the last row and column cut short where M or N is not a multiple of 128 (DeepSeek-V3's
`kv_a_proj_with_mqa` is 576 x 7168: 4.5 blocks of rows). DeepSeek's `inference/kernel.py` (`weight_dequant`, a
ceil-divided grid with masked edges) computes

    W[i, j] = float(W8[i, j]) * scale_inv[i // 128, j // 128]

and so does `dequantize_fp8`. transformers 5.23's CPU path instead derives the block from the grid (rows // scale
rows), which for a ragged matrix is another block size: 144 rows with 2 scale rows read as 72-row blocks (that
weight off by 23 % of its largest value), 576 with 5 refused; so moe-lm reads these weights itself.
Another `quant_method` (compressed-tensors, mxfp4, awq, gptq, bitsandbytes) is refused in one line: its numbers
mean something else.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_lm.errors import UserError
from moe_lm.interop.safetensors_folder import SafetensorsFolder

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = ("F8_E4M3",)
KNOWN_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn}


def block_size(config: dict, where: Path) -> tuple[int, int] | None:
    """The FP8 block a checkpoint's config declares (None: unquantised); a UserError for a quantisation moe-lm does
    not read, naming it and what to do."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        raise UserError(
            f"{where / 'config.json'}: weights quantised with {method or q!r}"
            f"{'' if method != 'fp8' else ' (' + str(q.get('fmt')) + ')'}; moe-lm reads unquantised checkpoints and "
            "DeepSeek's FP8 release format (quant_method fp8, e4m3, 128 x 128 blocks): give the bf16 release, or "
            "dequantise it to bf16 with its own tools first"
        )
    block = q.get("weight_block_size") or [128, 128]
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UserError(f"{where / 'config.json'}: weight_block_size {block!r} is not two block sides")
    return block[0], block[1]


def dequantize_fp8(w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """`w8` (M x N, float8_e4m3fn) times its block's scale, in float32 (DeepSeek's rule; ragged last blocks)."""
    M, N = w8.shape
    rows, cols = -(-M // block[0]), -(-N // block[1])
    if tuple(scale_inv.shape) != (rows, cols):
        raise ValueError(f"a scale grid of {list(scale_inv.shape)} for a {M} x {N} weight in {block[0]} x {block[1]} "
                         f"blocks (it needs {rows} x {cols})")  # fmt: skip
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:M].repeat_interleave(block[1], 1)[:, :N]
    return w8.float() * scale


class ReleasedWeights:
    """The weights of a transformers checkpoint folder (config.json beside its safetensors), each read as `dtype`:
    `weight(name)`; `names()` and `shape(name)` from the headers alone. Every error names the file or the tensor."""

    def __init__(self, folder: str | Path, config: dict | None = None) -> None:
        self.folder = Path(folder)
        if config is None:
            config = json.loads((self.folder / "config.json").read_text())
        self.block = block_size(config, self.folder)
        self.files = SafetensorsFolder(self.folder, "download or convert the checkpoint again")

    def names(self) -> list[str]:
        """The tensors of the model (the FP8 scales are read with their weights, not listed)."""
        return [n for n in self.files.names() if not n.endswith(SCALE_SUFFIX)]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files.shape(name)

    def nbytes(self, name: str) -> int:
        """Bytes read for `name` (with its scale)."""
        scale = name + SCALE_SUFFIX
        return self.files.nbytes(name) + (self.files.nbytes(scale) if scale in self.files else 0)

    def weight(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return next(self.weights([name], dtype))[1]

    def weights(self, names: list[str], dtype: torch.dtype = torch.float32):
        """(name, tensor as `dtype`) for `names`, a shard open at a time; FP8 weights dequantised on the way."""
        for name in names:
            kind = self.files.dtype(name)
            if kind not in KNOWN_DTYPES:
                raise UserError(f"{self.files.files[name]}: tensor {name} is stored as {kind}, which moe-lm does not "
                                "read (bf16, fp16, fp32, FP8 e4m3 with block scales)")  # fmt: skip
        wanted = list(names) + [n + SCALE_SUFFIX for n in names if self.files.dtype(n) in FP8_DTYPES]
        if missing := [n for n in wanted if n not in self.files]:
            raise UserError(f"{self.folder}: {missing[0]} is missing from its safetensors files (an FP8 weight needs "
                            "its scale); download or convert the checkpoint again")  # fmt: skip
        got = dict(self.files.tensors(wanted))
        for name in names:
            tensor = got.pop(name)
            if tensor.dtype == torch.float8_e4m3fn:
                try:
                    tensor = dequantize_fp8(tensor, got.pop(name + SCALE_SUFFIX), self.block or (128, 128))
                except ValueError as e:
                    raise UserError(f"{self.files.files[name]}: {name}: {e}; the checkpoint is damaged") from None
            yield name, tensor.to(dtype)
