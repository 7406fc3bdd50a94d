"""Routing traces: what the router actually chose for every token, streamed to disk, memory-mapped to read.

Format (a folder, append-only while recording; `meta.json` is written last and names the row count):
    meta.json              layers, n_experts, k, domains, n_tokens, n_docs, source, windows (the context's cut), format
                           version
    token.u32              token id                     [N] uint32
    doc.u32                document index (0..D-1)      [N] uint32
    pos.u32                position in the document     [N] uint32
    domain.u16             domain index into meta       [N] uint16
    experts_L{l}.u8/u16    chosen experts, rank order   [N, K] uint8 (E <= 256) or uint16, one file per MoE layer
    weights_L{l}.f16       their gate weights            [N, K] float16
    margin_L{l}.f32        each decision's margin       [N] float32 (format 2; NaN where the scores are not known)
    logprob.f32            log p(token | its window's earlier tokens)  [N] float32 (format 2; NaN first in a window)
Tokens of one document are contiguous and in order, so consecutive rows with the same doc are neighbours.

Recording reads what the router chose, never a recomputation from logits (under biased, group-limited routing only
the router knows what it chose): forward hooks on the routers' outputs (the `Routing` ours return, or the (logits,
weights, indices) of a transformers gate; see hf_routing.py), or llama.cpp's own graph tensors for a GGUF file
(moe_lm/interop/llama_cpp.py). A trace of format 1 (no margins, no log-probs) still reads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from moe_lm.compat import old_form
from moe_lm.errors import ConfigError, DataError, NotFound, shown
from moe_lm.routing.recorder import Routed, RoutingRecorder

FORMAT_VERSION = 2  # 2: margin_L{l}.f32 and logprob.f32


@dataclass
class DocChunk:
    doc: int  # document index in the trace
    domain: int
    start: int  # position of tokens[0] in the document
    tokens: np.ndarray


class Trace:
    """Read side: memory-mapped columns of a recorded trace. A trace travels like a run folder: its meta.json, the
    size of every column and the expert ids are checked (DataError naming the file) before anything counts them."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        meta_path = self.folder / "meta.json"
        if not meta_path.is_file():
            raise NotFound(f"{self.folder} is not a complete trace (no meta.json)")
        try:
            self.meta = json.loads(meta_path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"{meta_path} is not JSON ({e}); record the trace again (moe-lm analyze)") from None
        if problem := _meta_problem(self.meta):
            raise DataError(f"{meta_path} is damaged ({problem}); record the trace again (moe-lm analyze)")
        self.n = self.meta["n_tokens"]
        self.layers: list[int] = self.meta["layers"]
        self.n_experts: int = self.meta["n_experts"]
        self.k: int = self.meta["k"]
        self.domains: list[str] = self.meta["domains"]
        self.token = self._col("token.u32", np.uint32)
        self.doc = self._col("doc.u32", np.uint32)
        self.pos = self._col("pos.u32", np.uint32)
        self.domain = self._col("domain.u16", np.uint16)
        self._checked: set[int] = set()
        if self.meta.get("format_version", 1) < FORMAT_VERSION:
            old_form(f"the trace {self.folder} (format 1)", "record it again (moe-lm analyze)")

    def _col(self, name: str, dtype, width: int | None = None) -> np.ndarray:
        shape = (self.n,) if width is None else (self.n, width)
        path = self.folder / name
        want = self.n * (width or 1) * np.dtype(dtype).itemsize
        size = path.stat().st_size if path.is_file() else None
        if size != want:
            got = "missing" if size is None else f"{size} bytes"
            raise DataError(f"{path} is {got}; meta.json's {self.n} rows need {want}: the trace is damaged, record it "
                            "again (moe-lm analyze)")  # fmt: skip
        if self.n == 0:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype=dtype, mode="r", shape=shape)

    def experts(self, layer: int) -> np.ndarray:
        """[N, K] chosen experts of MoE layer `layer` (a model layer index), first choice first."""
        name = f"experts_L{layer}.{_expert_suffix(self.n_experts)}"
        col = self._col(name, _expert_dtype(self.n_experts), self.k)
        if layer not in self._checked:  # why once: an id past the experts would index out of every count
            top = int(col.max()) if col.size else -1
            if top >= self.n_experts:
                raise DataError(f"{self.folder / name} holds expert {top}, but the trace has {self.n_experts} experts: "
                                "it is damaged; record it again (moe-lm analyze)")  # fmt: skip
            self._checked.add(layer)
        return col

    def weights(self, layer: int) -> np.ndarray:
        return self._col(f"weights_L{layer}.f16", np.float16, self.k)

    def margins(self, layer: int) -> np.ndarray | None:
        """[N] each decision's margin (stats.decision_margins), or None in a trace of format 1."""
        return self._col(f"margin_L{layer}.f32", np.float32) if self.meta.get("format_version", 1) >= 2 else None

    @property
    def logprob(self) -> np.ndarray | None:
        """[N] each token's log-prob given its window's earlier tokens, or None in a trace of format 1."""
        return self._col("logprob.f32", np.float32) if self.meta.get("format_version", 1) >= 2 else None


def _meta_problem(meta) -> str | None:
    """What is wrong with a trace's meta.json (a missing field, a value of the wrong type), or None."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    counts = {"n_tokens": 0, "n_experts": 1, "k": 1}
    for key, least in counts.items():
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            return f"{key} is {shown(value)}"
    if meta["k"] > meta["n_experts"]:
        return f"k={meta['k']} > n_experts={meta['n_experts']}"
    layers, domains = meta.get("layers"), meta.get("domains")
    if not isinstance(layers, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
        return f"layers is {shown(layers)}"
    if not isinstance(domains, list) or not all(isinstance(x, str) for x in domains):
        return f"domains is {shown(domains)}"
    return None


class TraceWriter:
    def __init__(self, folder: Path, layers: list[int], n_experts: int, k: int, domains: list[str], source: dict):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "meta.json").unlink(missing_ok=True)
        self.folder, self.layers, self.n_experts, self.k, self.domains, self.source = (
            folder,
            layers,
            n_experts,
            k,
            domains,
            source,
        )
        suffix = _expert_suffix(n_experts)
        names = ["token.u32", "doc.u32", "pos.u32", "domain.u16", "logprob.f32"]
        names += [f"experts_L{layer}.{suffix}" for layer in layers] + [f"weights_L{layer}.f16" for layer in layers]
        names += [f"margin_L{layer}.f32" for layer in layers]
        self.files = {name: open(folder / name, "wb") for name in names}  # noqa: SIM115 - closed in close()
        self.n = 0
        self.docs = set()

    def append(self, token, doc, pos, domain, routed: Routed) -> None:
        """Rows in order: their token ids, document, position and domain, and how they were routed."""
        f, n = self.files, len(token)
        np.asarray(token, np.uint32).tofile(f["token.u32"])
        np.asarray(doc, np.uint32).tofile(f["doc.u32"])
        np.asarray(pos, np.uint32).tofile(f["pos.u32"])
        np.asarray(domain, np.uint16).tofile(f["domain.u16"])
        np.asarray(routed.logprob, np.float32).reshape(n).tofile(f["logprob.f32"])
        suffix = _expert_suffix(self.n_experts)
        for layer in self.layers:
            np.asarray(routed.experts[layer], _expert_dtype(self.n_experts)).tofile(f[f"experts_L{layer}.{suffix}"])
            np.asarray(routed.weights[layer], np.float16).tofile(f[f"weights_L{layer}.f16"])
            margin = routed.margins.get(layer)
            margin = np.full(n, np.nan) if margin is None or len(margin) != n else margin
            np.asarray(margin, np.float32).tofile(f[f"margin_L{layer}.f32"])
        self.n += n
        self.docs.update(np.unique(doc).tolist())

    def close(self, extra: dict | None = None) -> Trace:
        for fh in self.files.values():
            fh.close()
        meta = {
            "format_version": FORMAT_VERSION,
            "layers": self.layers,
            "n_experts": self.n_experts,
            "k": self.k,
            "domains": self.domains,
            "n_tokens": self.n,
            "n_docs": len(self.docs),
            "source": self.source,
            **(extra or {}),
        }
        (self.folder / "meta.json").write_text(json.dumps(meta, indent=1))
        return Trace(self.folder)


def document_chunks(docs: Iterable[tuple[int, np.ndarray]], seq_len: int) -> Iterator[DocChunk]:
    """Cut each (domain, tokens) document into chunks of at most seq_len tokens (context restarts per chunk)."""
    for d, (domain, tokens) in enumerate(docs):
        for start in range(0, len(tokens), seq_len):
            yield DocChunk(d, domain, start, np.asarray(tokens[start : start + seq_len]))


def budgeted_chunks(docs: Iterable[tuple[int, np.ndarray]], seq_len: int, max_tokens: int | None) -> Iterator[DocChunk]:
    """`document_chunks`, stopping at `max_tokens` tokens in all (the last chunk cut to fit; None: no limit)."""
    given = 0
    for chunk in document_chunks(docs, seq_len):
        if max_tokens is not None:
            room = max_tokens - given
            if room <= 0:
                break
            chunk.tokens = chunk.tokens[:room]
        given += len(chunk.tokens)
        yield chunk


MAX_BATCH_LOGIT_BYTES = 1 << 30  # a forward pass's float32 logits, the largest thing a recording batch holds


def bounded_batch(batch_size: int, seq_len: int, vocab_size: int) -> int:
    """`batch_size` windows per forward pass, fewer where their logits alone would pass MAX_BATCH_LOGIT_BYTES (a
    129 k vocabulary: two 1,024-token windows)."""
    return max(1, min(batch_size, MAX_BATCH_LOGIT_BYTES // (seq_len * max(vocab_size, 1) * 4)))


def chunk_batches(chunks: Iterable[DocChunk], batch_size: int) -> Iterator[list[DocChunk]]:
    """Consecutive chunks in batches of `batch_size` (the last one shorter)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    batch: list[DocChunk] = []
    for chunk in chunks:
        batch.append(chunk)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


class TorchRouting:
    """A PyTorch model (our Transformer, or an HFMoEModel) as a routing source: its routers' choices through hooks,
    and each token's log-prob from its logits. `route_batch(chunks)` runs them right-padded in one forward pass."""

    def __init__(self, model) -> None:
        if model.cfg.attn_mask != "causal":
            raise ConfigError("recording needs a causal model (padding would leak into a bidirectional prefix)")
        self.model = model.eval()
        self.recorder = RoutingRecorder(model, margins=True)
        self.n_experts, self.k = model.cfg.moe.n_routed_experts, model.cfg.moe.num_experts_per_tok
        self.layers = self.recorder.layers

    def __enter__(self) -> TorchRouting:
        self.recorder.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.recorder.__exit__(*exc)

    @torch.no_grad()
    def route_batch(self, batch: list[DocChunk]) -> Routed:
        S = max(len(c.tokens) for c in batch)
        tokens = torch.zeros(len(batch), S, dtype=torch.long)  # right padding: causal, so it cannot affect real tokens
        valid = torch.zeros(len(batch), S, dtype=torch.bool)
        for b, c in enumerate(batch):
            tokens[b, : len(c.tokens)] = torch.from_numpy(c.tokens.astype(np.int64))
            valid[b, : len(c.tokens)] = True
        self.recorder.last.clear()
        self.recorder.margins.clear()
        out = self.model(tokens)  # the inference path: decoder layers only (a model's MTP modules do not run)
        logits = out.logits if hasattr(out, "logits") else out[0]
        real = valid.flatten().numpy()
        layers = [layer for layer in self.layers if layer in self.recorder.last]  # those that ran
        margins = {layer: m.reshape(-1)[real] for layer, m in self.recorder.margins.items()}
        return Routed(
            {layer: self.recorder.last[layer][0][valid.flatten()].numpy() for layer in layers},
            {layer: self.recorder.last[layer][1][valid.flatten()].numpy() for layer in layers},
            margins,
            np.concatenate(
                [window_logprobs(logits[b, : len(c.tokens)], tokens[b, : len(c.tokens)]) for b, c in enumerate(batch)]
            ),  # fmt: skip
        )


def window_logprobs(logits_SV: torch.Tensor, tokens_S: torch.Tensor) -> np.ndarray:
    """log p(token t | tokens < t) in one window [S] (NaN at t = 0), without holding its whole softmax."""
    logits = logits_SV[:-1].float()
    picked = logits.gather(-1, tokens_S[1:, None].to(logits.device))[:, 0] - torch.logsumexp(logits, dim=-1)
    return np.concatenate([[np.nan], picked.cpu().double().numpy()])


@torch.no_grad()
def record_trace(
    model,
    docs: Iterable[tuple[int, np.ndarray]],
    out: str | Path,
    domains: list[str],
    seq_len: int,
    batch_size: int = 16,
    max_tokens: int | None = None,
    source: dict | None = None,
    progress: bool | str = True,
) -> Trace:
    """Run `model` over documents (domain index, token ids) and stream every token's routing to `out`. `model`: a
    PyTorch model (our Transformer, an HFMoEModel), or a routing source of its own with `route_batch(chunks)`,
    `layers`, `n_experts` and `k` (a GGUF file in llama.cpp). `progress`: a progress bar (a string labels it),
    counting the tokens given when `docs` is a list."""
    routing = model if hasattr(model, "route_batch") else TorchRouting(model)
    writer: TraceWriter | None = None  # made at the first batch: its layers are the routers that ran
    t0 = time.perf_counter()
    bar = _progress_bar(docs, max_tokens, progress)
    with routing:
        for batch in chunk_batches(budgeted_chunks(docs, seq_len, max_tokens), batch_size):
            routed = routing.route_batch(batch)
            if writer is None:
                layers = [layer for layer in routing.layers if layer in routed.experts]
                writer = TraceWriter(Path(out), layers, routing.n_experts, routing.k, domains, source or {})
            writer.append(
                np.concatenate([c.tokens for c in batch]),
                np.concatenate([np.full(len(c.tokens), c.doc) for c in batch]),
                np.concatenate([np.arange(c.start, c.start + len(c.tokens)) for c in batch]),
                np.concatenate([np.full(len(c.tokens), c.domain) for c in batch]),
                routed,
            )
            bar.update(sum(len(c.tokens) for c in batch))
    bar.close()
    if writer is None:  # no documents: an empty trace (the caller says there is nothing to analyse)
        writer = TraceWriter(Path(out), list(routing.layers), routing.n_experts, routing.k, domains, source or {})
    seconds = time.perf_counter() - t0
    return writer.close({"record_seconds": seconds, "tokens_per_s": writer.n / max(seconds, 1e-9), "windows": seq_len})


def _progress_bar(docs: Iterable[tuple[int, np.ndarray]], max_tokens: int | None, progress: bool | str) -> tqdm:
    """A token-counting bar (disabled when `progress` is False); its total is known only when `docs` is a list."""
    total = sum(len(tokens) for _, tokens in docs) if isinstance(docs, list) else None
    if max_tokens is not None:
        total = max_tokens if total is None else min(total, max_tokens)
    label = progress if isinstance(progress, str) else "recording routing"
    return tqdm(total=total, desc=label, unit="tok", disable=not progress, leave=False)


def _expert_dtype(n_experts: int):
    return np.uint8 if n_experts <= 256 else np.uint16


def _expert_suffix(n_experts: int) -> str:
    return "u8" if n_experts <= 256 else "u16"
