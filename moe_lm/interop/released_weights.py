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
import shutil
from pathlib import Path

import torch

from moe_lm.errors import UserError
from moe_lm.interop.safetensors_folder import SafetensorsFolder

SCALE_SUFFIX = "_scale_inv"
FP8_MAX = 448.0  # the largest float8_e4m3fn
FP8_DTYPES = ("F8_E4M3",)
FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()  # by bit pattern
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
            f"{where / 'config.json'}: weights quantised with {method or repr(q)}"
            f"{'' if method != 'fp8' else ' (' + str(q.get('fmt')) + ')'}; moe-lm reads unquantised checkpoints and "
            "DeepSeek's FP8 release format (quant_method fp8, e4m3, 128 x 128 blocks): give the bf16 release, or "
            "dequantise it to bf16 with its own tools first"
        )
    block = q.get("weight_block_size") or [128, 128]
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise UserError(f"{where / 'config.json'}: weight_block_size {block!r} is not two block sides")
    return block[0], block[1]


def dequantize_fp8(w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """`w8` (M x N, float8_e4m3fn) times its block's scale, in float32 (DeepSeek's rule; ragged last blocks); a block
    row at a time, so that no full-size scale matrix is made beside the weight."""
    M, N = w8.shape
    rows, cols = -(-M // block[0]), -(-N // block[1])
    if tuple(scale_inv.shape) != (rows, cols):
        raise ValueError(f"a scale grid of {list(scale_inv.shape)} for a {M} x {N} weight in {block[0]} x {block[1]} "
                         f"blocks (it needs {rows} x {cols})")  # fmt: skip
    # Each of the 256 codes looked up in a table: the same numbers as w8.to(float32), 3x faster on CPU (torch casts
    # FP8 element by element, ~0.1 GB/s a core; the reading of DeepSeek-V3 would wait on it).
    w = torch.from_numpy(FP8_VALUES[w8.view(torch.uint8).numpy()])
    per_column = scale_inv.float().repeat_interleave(block[1], 1)[:, :N]  # each block row's scale of every column
    for i in range(rows):
        w[i * block[0] : (i + 1) * block[0]].mul_(per_column[i])
    return w


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

    def check(self, names: list[str] | None = None) -> None:
        """Every tensor of `names` readable, from the headers alone: a dtype moe-lm reads, an FP8 weight's scale
        present and its grid fitting the weight. Without `names` (the whole checkpoint, as a model is opened) also
        every FP8 block scale finite (the scales are read: 1/16,384 of the weights). A UserError naming the file and
        the tensor (a long analysis fails before it starts, not hours in)."""
        if names is None:
            self.check(self.names())
            scales = [n + SCALE_SUFFIX for n in self.names() if self.files.dtype(n) in FP8_DTYPES]
            for scale, values in self.files.tensors(scales):
                self._finite(scale[: -len(SCALE_SUFFIX)], values)
            return
        for name in names:
            kind = self.files.dtype(name)
            if kind not in KNOWN_DTYPES:
                raise UserError(f"{self.files.files[name]}: tensor {name} is stored as {kind}, which moe-lm does not "
                                "read (bf16, fp16, fp32, FP8 e4m3 with block scales)")  # fmt: skip
            if kind not in FP8_DTYPES:
                continue
            scale = name + SCALE_SUFFIX
            if scale not in self.files:
                raise UserError(f"{self.folder}: the FP8 weight {name} has no {scale} in its safetensors files; "
                                "download or convert the checkpoint again")  # fmt: skip
            block, shape = self.block or (128, 128), self.files.shape(name)
            grid = tuple(-(-d // b) for d, b in zip(shape, block, strict=False))
            if len(shape) != 2 or self.files.shape(scale) != grid:
                raise UserError(f"{self.files.files[scale]}: {scale} is a grid of {list(self.files.shape(scale))} "
                                f"scales for a {' x '.join(map(str, shape))} weight in {block[0]} x {block[1]} blocks "
                                f"(it needs {list(grid)}); the checkpoint is damaged")  # fmt: skip

    def weights(self, names: list[str], dtype: torch.dtype = torch.float32):
        """(name, tensor as `dtype`) for `names`, a shard open at a time, in the order read (not `names`' order);
        FP8 weights dequantised on the way."""
        self.check(names)
        wanted = list(names) + [n + SCALE_SUFFIX for n in names if self.files.dtype(n) in FP8_DTYPES]
        asked = set(names)
        scales, waiting = {}, {}  # a weight and its scale may come from two shards: each held until both are read
        for name, tensor in self.files.tensors(wanted):
            if name not in asked:
                scales[name[: -len(SCALE_SUFFIX)]] = tensor
            else:
                waiting[name] = tensor
            for ready in [n for n in waiting if waiting[n].dtype != torch.float8_e4m3fn or n in scales]:
                yield ready, self._as(ready, waiting.pop(ready), scales.pop(ready, None), dtype)

    def _finite(self, name: str, scale: torch.Tensor) -> None:
        """A UserError naming `name`'s scale when a block scale is NaN or infinite: every value of its block would
        be, and the routing computed on them would be garbage with no error."""
        bad = ~torch.isfinite(scale.float())
        if bad.any():
            first = [int(i) for i in bad.nonzero()[0]]
            raise UserError(f"{self.files.files[name + SCALE_SUFFIX]}: {name}{SCALE_SUFFIX} holds {int(bad.sum())} "
                            f"NaN or infinite block scales (the first at block {first}); the checkpoint is damaged: "
                            "download or convert it again")  # fmt: skip

    def _as(self, name: str, tensor: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if tensor.dtype == torch.float8_e4m3fn:
            self._finite(name, scale)
            try:
                tensor = dequantize_fp8(tensor, scale, self.block or (128, 128))
            except ValueError as e:
                raise UserError(f"{self.files.files[name]}: {name}: {e}; the checkpoint is damaged") from None
        return tensor.to(dtype)


# ---- the format written, for tests and benchmarks: a model as DeepSeek releases one --------------------------------


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block) of `w`: each block scaled so that its largest value is the
    format's largest, as DeepSeek quantises (ragged last blocks)."""
    M, N = w.shape
    rows, cols = -(-M // block[0]), -(-N // block[1])
    padded = torch.zeros(rows * block[0], cols * block[1])
    padded[:M, :N] = w.float()
    blocks = padded.view(rows, block[0], cols, block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)
    w8 = (blocks / scale[:, None, :, None]).view(rows * block[0], cols * block[1])[:M, :N].to(torch.float8_e4m3fn)
    return w8.contiguous(), scale


def fp8_quantised(name: str, tensor: torch.Tensor) -> bool:
    """What DeepSeek's release stores in FP8: every matrix but the embedding, the output head and the router."""
    return tensor.dim() == 2 and not any(k in name for k in ("embed_tokens", "lm_head", "mlp.gate.weight", "norm"))


def write_fp8_release(model, folder: str | Path, shards: int = 3, dtype: torch.dtype = torch.bfloat16) -> None:
    """A transformers `model` written into a new `folder` as DeepSeek releases its checkpoints: transformers' own
    on-disk names (save_pretrained's), the matrices in FP8 blocks with their scales, the rest in `dtype` (the
    selection bias in float32), `shards` files with an index, config.json's quantization_config saying so."""
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    plain = folder / ".plain"
    folder.mkdir(parents=True)
    model.save_pretrained(plain)
    stored: dict[str, torch.Tensor] = {}
    for file in sorted(plain.glob("*.safetensors")):
        for name, t in load_file(file).items():
            if fp8_quantised(name, t):
                stored[name], stored[name + SCALE_SUFFIX] = quantize_fp8(t)
            else:
                stored[name] = t.float() if name.endswith("e_score_correction_bias") else t.to(dtype)
    config = json.loads((plain / "config.json").read_text())
    shutil.rmtree(plain)
    names = sorted(stored)  # a weight and its scale side by side, as in DeepSeek's shards
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: stored.pop(n) for n in names[s * len(names) // shards : (s + 1) * len(names) // shards]}
        save_file(part, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))
