"""Routing traces: what the router actually chose for every token, as files (the format, its reader and its writer).
A routed model writes its rows into a `TraceWriter` (routed_model.py, `RoutedModel.record_into`; the analytics'
recorder, moe_lm/analysis/recording.py, cuts the windows); the analytics' report and the planner (moe_lm/planning:
the all-to-all of a trace, expert placement) read a `Trace`. Here, on the routing floor, so that both can name it.

Format 3 (a folder; `meta.json` is written last and names the row count):
    meta.json              layers, n_experts, k, domains, n_tokens, n_docs, columns (the optional ones present),
                           windows (the length documents were cut into), provenance (what was recorded and from what),
                           format version
    token.u32              token id                     [N] uint32
    doc.u32                document index (0..D-1)      [N] uint32
    pos.u32                position in the document     [N] uint32
    domain.u16             domain index into meta       [N] uint16
    experts_L{l}.u8/u16    chosen experts, rank order   [N, K] uint8 (E <= 256) or uint16, one file per MoE layer
  optional, as `columns` says (a serving engine's record has experts only):
    weights_L{l}.f16       their gate weights           [N, K] float16
    margin_L{l}.f32        each decision's margin       [N] float32 (NaN where the scores are not known)
    logprob.f32            log p(token | its window's earlier tokens)  [N] float32 (NaN first in a window)
    norms_L{l}.f16         ‖f_j(t)‖₂ of each chosen expert's output, before the gate multiplies it  [N, K] float16
                           (moe-lm's own model, recorded since the pruning criteria, moe_lm/pruning/criteria.py)
Tokens of one document are contiguous and in order, so consecutive rows with the same doc are neighbours. A trace of
format 2 (every column then known, the provenance under "source") and of format 1 (no margins, no log-probs) still
reads; a trace without `norms` (any recorded before them, or by another kind of subject) reads as one without them.

The writer takes rows of every layer at once (`append`, what a forward pass gives) or, once the token columns are
written, one layer's columns for every token (`write_layer`, what a layer-by-layer pass gives).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moe_lm.compat import old_form
from moe_lm.errors import DataError, NotFound, shown
from moe_lm.routing.routed_model import OPTIONAL, Routed

FORMAT_VERSION = 3  # 2: margin_L{l}.f32 and logprob.f32; 3: optional columns named in meta, provenance
FORMAT_2_COLUMNS = ("weights", "margins", "logprob")  # a format-2 trace holds these, without naming them
TOKEN_COLUMNS = (("token.u32", np.uint32), ("doc.u32", np.uint32), ("pos.u32", np.uint32), ("domain.u16", np.uint16))


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
        self.token, self.doc, self.pos, self.domain = (self._col(name, dtype) for name, dtype in TOKEN_COLUMNS)
        self._checked: set[int] = set()
        version = self.meta.get("format_version", 1)
        if version < FORMAT_VERSION:
            old_form(f"the trace {self.folder} (format {version})", "record it again (moe-lm analyze)")
        # what each format holds of the optional columns: format 1 gate weights only, format 2 all of them
        self.columns = frozenset(self.meta.get("columns", ["weights"] if version < 2 else FORMAT_2_COLUMNS))
        self.provenance: dict = self.meta.get("provenance", self.meta.get("source", {}))
        # False: each token's experts are a set in id order (Megatron's trace), so there is no first choice
        self.ranked: bool = self.meta.get("ranked", True)

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
        """[N, K] chosen experts of MoE layer `layer` (a model layer index), first choice first (`ranked`)."""
        name = f"experts_L{layer}.{_expert_suffix(self.n_experts)}"
        col = self._col(name, _expert_dtype(self.n_experts), self.k)
        if layer not in self._checked:  # why once: an id past the experts would index out of every count
            top = int(col.max()) if col.size else -1
            if top >= self.n_experts:
                raise DataError(f"{self.folder / name} holds expert {top}, but the trace has {self.n_experts} experts: "
                                "it is damaged; record it again (moe-lm analyze)")  # fmt: skip
            self._checked.add(layer)
        return col

    def weights(self, layer: int) -> np.ndarray | None:
        """[N, K] the gate weights of the chosen experts, or None where the subject does not give them."""
        return self._col(f"weights_L{layer}.f16", np.float16, self.k) if "weights" in self.columns else None

    def margins(self, layer: int) -> np.ndarray | None:
        """[N] each decision's margin (stats.decision_margins), or None where the subject does not give them."""
        return self._col(f"margin_L{layer}.f32", np.float32) if "margins" in self.columns else None

    def norms(self, layer: int) -> np.ndarray | None:
        """[N, K] the L2 norms of the chosen experts' outputs (before the gate weight), or None where not recorded."""
        return self._col(f"norms_L{layer}.f16", np.float16, self.k) if "norms" in self.columns else None

    @property
    def logprob(self) -> np.ndarray | None:
        """[N] each token's log-prob given its window's earlier tokens, or None where the subject does not give it."""
        return self._col("logprob.f32", np.float32) if "logprob" in self.columns else None


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
    columns = meta.get("columns", [])
    if not isinstance(columns, list) or not set(columns) <= set(OPTIONAL):
        return f"columns is {shown(columns)}"
    if not isinstance(meta.get("ranked", True), bool):
        return f"ranked is {shown(meta['ranked'])}"
    return None


class TraceWriter:
    """Write side: the columns of `layers` (and the optional ones in `columns`) into `folder`, then `close()` writes
    meta.json and returns the Trace. Rows of every layer at once (`append`), or the token columns first
    (`append_tokens`) and then each layer's columns for all of them (`write_layer`)."""

    def __init__(self, folder: Path, layers: list[int], n_experts: int, k: int, domains: list[str], provenance: dict,
                 columns=OPTIONAL) -> None:  # fmt: skip
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "meta.json").unlink(missing_ok=True)
        self.folder, self.layers, self.n_experts, self.k = folder, list(layers), n_experts, k
        self.domains, self.provenance, self.columns = domains, provenance, tuple(c for c in OPTIONAL if c in columns)
        self.files = {name: open(folder / name, "wb") for name, _ in TOKEN_COLUMNS}  # noqa: SIM115 - closed in close()
        if "logprob" in self.columns:
            self.files["logprob.f32"] = open(folder / "logprob.f32", "wb")  # noqa: SIM115
        for layer in self.layers:  # empty, so that a layer is written by appending to its own files only
            for name in self._layer_files(layer):
                (folder / name).write_bytes(b"")
        self.n, self.docs, self.layer_rows = 0, set(), dict.fromkeys(self.layers, 0)

    def _layer_files(self, layer: int) -> list[str]:
        optional = {"weights": f"weights_L{layer}.f16", "margins": f"margin_L{layer}.f32",
                    "norms": f"norms_L{layer}.f16"}  # fmt: skip
        return [f"experts_L{layer}.{_expert_suffix(self.n_experts)}"] + [
            optional[c] for c in self.columns if c in optional
        ]

    def append_tokens(self, token, doc, pos, domain, logprob=None) -> None:
        """Rows' token columns in order: their ids, document, position, domain (and log-prob, with that column)."""
        for (name, dtype), values in zip(TOKEN_COLUMNS, (token, doc, pos, domain), strict=True):
            np.asarray(values, dtype).tofile(self.files[name])
        if "logprob" in self.columns:
            n = len(token)
            np.asarray(logprob if logprob is not None else np.full(n, np.nan), np.float32).reshape(n).tofile(
                self.files["logprob.f32"]
            )
        self.n += len(token)
        self.docs.update(np.unique(np.asarray(doc)).tolist())

    def write_layer(self, layer: int, experts, weights=None, margins=None, norms=None) -> None:
        """Rows of one MoE layer, appended to its columns (all tokens in one call, or in the order they came)."""
        n = len(experts)
        with open(self.folder / f"experts_L{layer}.{_expert_suffix(self.n_experts)}", "ab") as f:
            np.asarray(experts, _expert_dtype(self.n_experts)).reshape(n, self.k).tofile(f)
        if "weights" in self.columns:
            with open(self.folder / f"weights_L{layer}.f16", "ab") as f:
                np.asarray(weights, np.float16).reshape(n, self.k).tofile(f)
        if "margins" in self.columns:
            margins = np.full(n, np.nan) if margins is None or len(margins) != n else margins
            with open(self.folder / f"margin_L{layer}.f32", "ab") as f:
                np.asarray(margins, np.float32).tofile(f)
        if "norms" in self.columns:
            norms = np.full((n, self.k), np.nan) if norms is None else norms
            with open(self.folder / f"norms_L{layer}.f16", "ab") as f:
                np.asarray(norms, np.float16).reshape(n, self.k).tofile(f)
        self.layer_rows[layer] += n

    def append(self, token, doc, pos, domain, routed: Routed) -> None:
        """Rows in order, every layer at once: their token columns and how they were routed."""
        self.append_tokens(token, doc, pos, domain, routed.logprob)
        for layer in self.layers:
            self.write_layer(layer, routed.experts[layer], (routed.weights or {}).get(layer),
                             (routed.margins or {}).get(layer), (routed.norms or {}).get(layer))  # fmt: skip

    def close(self, extra: dict | None = None) -> Trace:
        for fh in self.files.values():
            fh.close()
        short = {layer: rows for layer, rows in self.layer_rows.items() if rows != self.n}
        if short:  # a writer's caller forgot a layer's rows: never a trace whose columns disagree
            raise ValueError(f"layers {short} have other row counts than the {self.n} tokens")
        meta = {
            "format_version": FORMAT_VERSION, "layers": self.layers, "n_experts": self.n_experts, "k": self.k,
            "domains": self.domains, "n_tokens": self.n, "n_docs": len(self.docs), "columns": list(self.columns),
            "provenance": self.provenance, **(extra or {}),
        }  # fmt: skip
        (self.folder / "meta.json").write_text(json.dumps(meta, indent=1))
        return Trace(self.folder)


def _expert_dtype(n_experts: int):
    return np.uint8 if n_experts <= 256 else np.uint16


def _expert_suffix(n_experts: int) -> str:
    return "u8" if n_experts <= 256 else "u16"
