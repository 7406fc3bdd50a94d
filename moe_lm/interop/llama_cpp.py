"""A GGUF file run in llama.cpp (llama-cpp-python, the `llama` extra), as the analytics' third kind of subject:
every token's experts and gate weights as llama.cpp's own graph selected them, and each token's log-prob; and
llama.cpp's own quantiser (`quantize`: what `llama-quantize` runs), which writes the k-quants `moe-lm export
--gguf-type` and `analyze --quantise` ask for.

Read, never recomputed: llama.cpp's MoE block (`build_moe_ffn`, src/llama-graph.cpp) names its tensors
`ffn_moe_<what>-<block>`, the block index counting leading dense blocks (so it is moe-lm's layer id). Through the
context's evaluation callback (`cb_eval`) the scheduler asks, node by node, whether we want a tensor; for those we
answer yes to it computes up to that node and hands it over:
    ffn_moe_topk        [k, T] int32, a strided view of the argsort: the selected experts, best selection score first
    ffn_moe_weights...  the gate weights at each stage; the last stage present is what multiplies the experts'
                        outputs: weights_scaled > weights_norm > weights_softmax > weights
    ffn_moe_probs_biased / ffn_moe_probs   [E, T] the selection scores (with and without the selection-only bias),
                        for each decision's margin (a near tie can flip under any rounding)
    ffn_moe_down(_biased)  [n_embd, k, T] each chosen expert's output before its gate weight multiplies it (the
                        down projection, and its bias where the architecture has one): REAP's ‖f_j(x)‖₂ per slot
The router weights (`ffn_gate_inp`) are never quantised by llama.cpp, so whatever changes the choices of a quantised
file comes from the layers below each router.

How it is run, and why (each checked against moe-lm's own routing on the same token ids, tests/interop/):
- one sequence per decode, every position an output (the last block runs its MoE only on output rows);
- the KV cache in f32 and flash attention off by default (`faithful`): llama.cpp's defaults (an f16 cache, flash
  attention on CPU) flip a few near-tie decisions of an f32 file; `faithful=False` measures the defaults;
- an exception inside the callback would make it return False, which silently stops the graph: every error is
  kept and raised after the decode instead;
- every llama.cpp call that may call back into Python (its log, the evaluation callback) runs with Ctrl-C, SIGTERM
  and SIGHUP held (held_signals.py: one raised inside a callback would be dropped); a signal noted during a decode
  stops its graph at the next node, and is raised when the call returns.
"""

from __future__ import annotations

import ctypes
import math
import re
from pathlib import Path

import numpy as np

from moe_lm.data.tokenizer import SPECIAL, Tokenizer
from moe_lm.errors import DataError, UserError, require, shown
from moe_lm.interop.gguf_header import GGUFHeader, read_gguf_header
from moe_lm.interop.gguf_header import tensor_types as header_tensor_types
from moe_lm.interop.held_signals import held_signals
from moe_lm.interop.llama_process import probe, quantize_in_child
from moe_lm.routing.routed_model import BatchRouted, Routed, Window
from moe_lm.routing.stats import decision_margins

EXTRA = "llama"  # pip install -e '.[llama]': llama-cpp-python, built from source
WANT = re.compile(
    rb"^ffn_moe_(topk|weights|weights_softmax|weights_norm|weights_scaled|probs|probs_biased|down|down_biased)-(\d+)$"
)
FINAL = ("weights_scaled", "weights_norm", "weights_softmax", "weights")  # the last stage present is applied
GGML_TYPE_F32 = 0


def _llama_cpp():
    return require("llama_cpp", EXTRA, "a GGUF subject (moe-lm analyze --gguf, --compare FILE.gguf)")


def _ggml():
    """ggml's base library, the copy llama.cpp loaded (its bare soname: the wheel also ships a second file of it,
    which would be a second, separate ggml)."""
    _llama_cpp()
    g = ctypes.CDLL("libggml-base.so.0")
    g.ggml_get_name.restype, g.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    for name, kind in (("ggml_nbytes", ctypes.c_size_t), ("ggml_element_size", ctypes.c_size_t),
                       ("ggml_nelements", ctypes.c_int64), ("ggml_nrows", ctypes.c_int64),
                       ("ggml_is_contiguous", ctypes.c_bool)):  # fmt: skip
        getattr(g, name).restype, getattr(g, name).argtypes = kind, [ctypes.c_void_p]
    g.ggml_backend_tensor_get.restype = None
    g.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return g


def check_gguf(path: Path) -> GGUFHeader:
    """The header of `path`, read and checked by moe-lm (gguf_header.py) and holding what llama.cpp asserts of an
    MoE model's keys (`moe_problems`); a UserError naming the file otherwise. llama.cpp itself sees it after."""
    header = read_gguf_header(path)
    if problems := moe_problems(header):
        raise UserError(f"{path}: {'; '.join(problems)}: llama.cpp would abort on it; convert the model again")
    return header


LLAMA_MAX_EXPERTS = 1024  # llama.cpp's cap (src/llama-hparams.h of the llama.cpp llama-cpp-python 0.3.36 vendors)


MOE_KEYS = ("expert_count", "expert_used_count", "block_count", "expert_group_count", "expert_group_used_count",
            "leading_dense_block_count", "nextn_predict_layers")  # fmt: skip


def moe_problems(header: GGUFHeader) -> list[str]:
    """What in a GGUF file's MoE keys llama.cpp's loader asserts (llama-model.cpp, load_hparams: a failed GGML_ASSERT
    aborts the process) or its graph cannot route, each as a phrase; [] for a file llama.cpp can run."""
    arch = header.fields.get("general.architecture")
    if not isinstance(arch, str):
        return [f"general.architecture is {shown(arch)}, not an architecture's name"]
    counts, wrong = {}, []
    for key in MOE_KEYS:
        value = header.get(key, 0)
        if isinstance(value, np.ndarray) and value.size and np.issubdtype(value.dtype, np.integer):
            value = int(value.max())  # a per-layer array (expert_used_count of some models): llama.cpp takes the max
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            wrong.append(f"{arch}.{key} is {shown(value)}")
            continue
        counts[key] = int(value)
    if wrong:
        return wrong
    E, k, blocks = counts["expert_count"], counts["expert_used_count"], counts["block_count"]
    groups, used = counts["expert_group_count"], counts["expert_group_used_count"]
    dense, nextn = counts["leading_dense_block_count"], counts["nextn_predict_layers"]
    problems = []
    if E > LLAMA_MAX_EXPERTS:
        problems.append(f"{arch}.expert_count {E} is above llama.cpp's {LLAMA_MAX_EXPERTS}")
    if E and not 1 <= k <= E:
        problems.append(f"{arch}.expert_used_count {k} is not between 1 and expert_count {E}")
    if E and groups >= E:
        problems.append(f"{arch}.expert_group_count {groups} is not below expert_count {E}")
    elif groups > 1 and (E % groups or not 1 <= used < groups):
        problems.append(f"expert groups {groups} (of which {used} used) do not split {E} experts: the groups must "
                        "divide the experts and fewer than all of them be used")  # fmt: skip
    elif groups > 1 and 1 <= k and k > used * (E // groups):
        problems.append(f"top-{k} of the {used * (E // groups)} experts in {used} of {groups} groups cannot be chosen")
    if blocks < 1 or dense + nextn >= blocks:
        problems.append(f"{arch}.block_count {blocks} leaves no MoE block after {dense} dense and {nextn} NextN blocks")
    return problems


class GGUFModel(BatchRouted):
    """A GGUF MoE model loaded in llama.cpp (CPU), with its tokenizer (`tok`): a RoutedModel
    (moe_lm/routing/routed_model.py) recorded a batch at a time. `route(tokens)` runs one sequence,
    `route_batch(windows)` several (what its recording calls). `close()` frees it (the tokenizer with it)."""

    gives = frozenset({"weights", "margins", "logprob", "norms"})

    def __init__(
        self, path: str | Path, threads: int = 1, faithful: bool = True, n_ctx: int = 1024, record: bool = True
    ) -> None:
        """`record=False`: llama.cpp without the callback, for the recorder's cost (`moe-lm bench served`)."""
        self.path = Path(path)
        self.header = check_gguf(self.path)
        lc = _llama_cpp()
        if problem := probe(self.path, n_ctx, threads, faithful):
            raise UserError(f"{self.path}: {problem}; the file is damaged or not one this llama.cpp runs")
        self._lc, self._g = lc, _ggml()
        _quiet(lc)
        params = lc.llama_model_default_params()
        params.n_gpu_layers = 0
        with held_signals():
            model = lc.llama_model_load_from_file(str(self.path).encode(), params)
        if not model:
            raise UserError(f"{self.path}: llama.cpp could not load it (a truncated file, or an architecture this "
                            "llama.cpp does not know); run with --verbose for llama.cpp's own message")  # fmt: skip
        self._model = model
        self.meta = self._metadata()
        self.arch = self.meta.get("general.architecture", "?")
        self.n_experts = int(self.meta.get(f"{self.arch}.expert_count", 0) or 0)
        self.k = int(self.meta.get(f"{self.arch}.expert_used_count", 0) or 0)
        if self.n_experts < 2 or self.k < 1:
            lc.llama_model_free(model)
            raise UserError(f"{self.path} is not a mixture-of-experts model ({self.arch}, no {self.arch}.expert_count)")
        self.n_groups = int(self.meta.get(f"{self.arch}.expert_group_count", 1) or 1)
        self.groups_used = int(self.meta.get(f"{self.arch}.expert_group_used_count", self.n_groups) or self.n_groups)
        n_layers = int(self.meta[f"{self.arch}.block_count"])
        dense = int(self.meta.get(f"{self.arch}.leading_dense_block_count", 0) or 0)
        # why without the last `nextn_predict_layers` blocks: they are MTP (NextN) modules, loaded but never run in a
        # forward pass (llama.cpp's deepseek2 and glm4moe graphs stop before them)
        nextn = int(self.meta.get(f"{self.arch}.nextn_predict_layers", 0) or 0)
        self.layers = list(range(dense, n_layers - nextn))
        self.vocab = lc.llama_model_get_vocab(model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_ctx, self.threads, self.faithful, self.record = n_ctx, threads, faithful, record
        self._got: list[tuple[str, int, np.ndarray]] = []
        self._errors: list[BaseException] = []
        self._signals: list[int] = []  # noted during a decode (held_signals): the graph stops at the next node
        self._callback = lc.ggml_backend_sched_eval_callback(self._on_eval)  # kept alive with the context
        self._ctx = self._context()
        self.tok = GGUFTokenizer(self)

    # ---- set-up ---------------------------------------------------------------------------------------------

    def _metadata(self) -> dict[str, str]:
        lc, out = self._lc, {}
        buf = ctypes.create_string_buffer(1 << 16)
        for i in range(lc.llama_model_meta_count(self._model)):
            lc.llama_model_meta_key_by_index(self._model, i, buf, len(buf))
            key = buf.value.decode("utf-8", "replace")
            lc.llama_model_meta_val_str_by_index(self._model, i, buf, len(buf))
            out[key] = buf.value.decode("utf-8", "replace")
        return out

    def _context(self):
        lc = self._lc
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = self.n_ctx, self.n_ctx, min(self.n_ctx, 512)
        cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 1, self.threads, self.threads
        if self.record:
            cp.cb_eval, cp.cb_eval_user_data = self._callback, None
        if self.faithful:
            cp.flash_attn_type = 0  # off (the low-level default, AUTO, is on for CPU)
            cp.type_k = cp.type_v = GGML_TYPE_F32
        with held_signals():
            ctx = lc.llama_init_from_model(self._model, cp)
        if not ctx:
            raise UserError(f"{self.path}: llama.cpp could not make a context of {self.n_ctx} tokens")
        return ctx

    def settings(self) -> dict:
        """What the recording ran with (kept in the trace's metadata)."""
        return {"gguf": str(self.path), "arch": self.arch, "file_type": self.meta.get("general.file_type"),
                "kv_cache": "f32" if self.faithful else "llama.cpp default (f16)",
                "flash_attention": "off" if self.faithful else "llama.cpp default (auto)", "threads": self.threads,
                "llama_cpp_python": getattr(self._lc, "__version__", "?")}  # fmt: skip

    def close(self) -> None:
        with held_signals():
            if getattr(self, "_ctx", None):
                self._lc.llama_free(self._ctx)
                self._ctx = None
            if getattr(self, "_model", None):
                self._lc.llama_model_free(self._model)
                self._model = None

    def __enter__(self) -> GGUFModel:  # a RoutedModel for the recorder; the model stays loaded (its tokenizer)
        return self

    def __exit__(self, *exc) -> None:
        pass

    def route_batch(self, windows: list[Window]) -> Routed:
        """The windows of a recording batch, one decode each, their rows joined in order."""
        routed = [self.route(window.tokens) for window in windows]
        return Routed(
            {layer: np.concatenate([r.experts[layer] for r in routed]) for layer in self.layers},
            {layer: np.concatenate([r.weights[layer] for r in routed]) for layer in self.layers},
            {layer: np.concatenate([r.margins[layer] for r in routed]) for layer in self.layers},
            np.concatenate([r.logprob for r in routed]),
            {layer: np.concatenate([r.norms[layer] for r in routed]) for layer in self.layers},
        )

    # ---- the callback -----------------------------------------------------------------------------------------

    def _on_eval(self, tensor, ask, user_data) -> bool:
        try:
            found = WANT.match(self._g.ggml_get_name(tensor) or b"")
            if ask:
                return found is not None
            if self._signals:
                return False  # stops the graph: the decode returns, and held_signals raises the signal
            kind, layer = found[1].decode(), int(found[2])
            self._got.append((kind, layer, self._read(tensor, np.int32 if kind == "topk" else np.float32)))
        except BaseException as e:  # noqa: BLE001 - raised after the decode; returning False would stop the graph
            self._errors.append(e)
        return True

    def _read(self, tensor, dtype) -> np.ndarray:
        """A tensor's data as [rows, ne0]; `ffn_moe_topk` is a strided view (its rows E apart), read by stride."""
        g = self._g
        nbytes, rows, size = g.ggml_nbytes(tensor), g.ggml_nrows(tensor), g.ggml_element_size(tensor)
        ne0 = g.ggml_nelements(tensor) // rows
        buf = np.empty(nbytes // size, dtype)
        g.ggml_backend_tensor_get(tensor, buf.ctypes.data, 0, nbytes)
        if g.ggml_is_contiguous(tensor):
            return buf.reshape(rows, ne0)
        stride = (buf.size - ne0) // (rows - 1) if rows > 1 else ne0
        return np.lib.stride_tricks.as_strided(buf, (rows, ne0), (stride * size, size)).copy()

    # ---- running ----------------------------------------------------------------------------------------------

    def route(self, tokens: np.ndarray) -> Routed:
        """Run one sequence of token ids (from position 0, the cache cleared) and return its routing and log-probs."""
        lc, T = self._lc, len(tokens)
        if T > self.n_ctx:
            raise ValueError(f"{T} tokens exceed the context of {self.n_ctx}")
        lc.llama_memory_clear(lc.llama_get_memory(self._ctx), True)
        batch = lc.llama_batch_init(T, 0, 1)
        try:
            for i, token in enumerate(np.asarray(tokens, dtype=np.int64).tolist()):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, 1  # every position an output (see the module's note)
            batch.n_tokens = T
            self._got.clear()
            self._errors.clear()
            with held_signals() as self._signals:
                rc = lc.llama_decode(self._ctx, batch)
            if self._errors:
                raise self._errors[0]
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} on {self.path}")
            logits = np.ctypeslib.as_array(lc.llama_get_logits(self._ctx), shape=(T, self.n_vocab))
            logprob = next_token_logprobs(logits, np.asarray(tokens))
        finally:
            lc.llama_batch_free(batch)
        return self._collect(T, logprob) if self.record else Routed({}, {}, {}, logprob)

    def _collect(self, T: int, logprob: np.ndarray) -> Routed:
        """The callback's tensors (per ubatch, layer by layer) joined per layer and kind."""
        parts: dict[tuple[str, int], list[np.ndarray]] = {}
        for kind, layer, array in self._got:
            parts.setdefault((kind, layer), []).append(array)
        joined = {key: np.concatenate(arrays) for key, arrays in parts.items()}
        experts, weights, margins, norms = {}, {}, {}, {}
        for layer in self.layers:
            idx = joined.get(("topk", layer))
            stage = next((s for s in FINAL if (s, layer) in joined), None)
            if idx is None or stage is None or len(idx) != T:
                raise DataError(f"{self.path}: llama.cpp's graph gave no routing for block {layer} of this sequence")
            experts[layer] = idx.astype(np.int64)
            weights[layer] = joined[(stage, layer)].reshape(T, -1)
            scores = joined.get(("probs_biased", layer), joined.get(("probs", layer)))
            margins[layer] = decision_margins(scores, self.k, self.n_groups, self.groups_used)
            down = joined.get(("down_biased", layer), joined.get(("down", layer)))  # the last stage before weighting
            if down is None or len(down) != T * self.k:
                raise DataError(f"{self.path}: llama.cpp's graph gave no expert outputs for block {layer}")
            norms[layer] = np.linalg.norm(down.reshape(T, self.k, -1), axis=-1)
        return Routed(experts, weights, margins, logprob, norms)


def next_token_logprobs(logits_TV: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """log p(token t | tokens < t) for t = 1 .. T - 1 from the logits of positions 0 .. T - 2 (NaN at t = 0);
    in blocks of rows, so a large vocabulary's softmax is never held whole."""
    out = np.full(len(tokens), math.nan, dtype=np.float64)
    for start in range(0, len(tokens) - 1, 64):
        rows = logits_TV[start : min(start + 64, len(tokens) - 1)].astype(np.float64)
        top = rows.max(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
        nxt = tokens[start + 1 : start + 1 + len(rows)]
        out[start + 1 : start + 1 + len(rows)] = rows[np.arange(len(rows)), nxt] - lse
    return out


class GGUFTokenizer(Tokenizer):
    """The GGUF file's own tokenizer, as llama.cpp runs it (no special-token parsing: documents are text)."""

    kind = "gguf"

    def __init__(self, model: GGUFModel) -> None:
        self._m = model
        lc = model._lc
        self.vocab_size = model.n_vocab
        bos, eos = lc.llama_vocab_bos(model.vocab), lc.llama_vocab_eos(model.vocab)
        self.bos_id = bos if bos >= 0 else None
        self.eos_id = eos if eos >= 0 else None
        self._pieces: dict[str, int] | None = None

    def encode(self, text: str) -> list[int]:
        lc, raw = self._m._lc, text.encode("utf-8")
        room = len(raw) + 16
        out = (lc.llama_token * room)()
        n = lc.llama_tokenize(self._m.vocab, raw, len(raw), out, room, False, False)
        if n < 0:  # more tokens than room: retry with what it asks for
            out = (lc.llama_token * -n)()
            n = lc.llama_tokenize(self._m.vocab, raw, len(raw), out, -n, False, False)
        return list(out[:n])

    def decode(self, ids: list[int]) -> str:
        return b"".join(self._piece_bytes(i) for i in ids).decode("utf-8", "replace")

    def _piece_bytes(self, i: int) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = self._m._lc.llama_token_to_piece(self._m.vocab, int(i), buf, len(buf), 0, False)
        return buf.raw[: max(n, 0)]

    def id_to_piece(self, i: int) -> str:
        return self._piece_bytes(i).decode("utf-8", "replace")

    def token_bytes(self, i: int) -> bytes:
        lc, vocab = self._m._lc, self._m.vocab
        if lc.llama_vocab_get_attr(vocab, int(i)) & (lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN):
            return SPECIAL + (lc.llama_vocab_get_text(vocab, int(i)) or b"")
        return self._piece_bytes(i)

    def piece_to_id(self, piece: str) -> int | None:
        if self._pieces is None:
            self._pieces = {}
            for i in range(self.vocab_size):
                self._pieces.setdefault(self.id_to_piece(i), i)
        return self._pieces.get(piece)


_LOG_CALLBACK = None  # kept alive for the process (llama.cpp calls it from C)


def _quiet(lc) -> None:
    """llama.cpp's own log lines off, unless --verbose (moe_lm.console)."""
    global _LOG_CALLBACK
    from moe_lm.console import verbose

    if _LOG_CALLBACK is None and not verbose():
        _LOG_CALLBACK = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


# GGUF types written by llama.cpp's own quantiser (`llama-quantize`), from an f32 file: the k-quants
K_QUANTS = {"q2_K": 10, "q3_K_S": 11, "q3_K_M": 12, "q3_K_L": 13, "q4_K_S": 14, "q4_K_M": 15, "q5_K_S": 16,
            "q5_K_M": 17, "q6_K": 18}  # fmt: skip


def quantize(source: Path, out: Path, kind: str, threads: int = 0) -> str:
    """`source` (an f32 GGUF) quantised to `kind` (K_QUANTS) by llama.cpp's `llama_model_quantize`, into `out`, in a
    process of its own (llama_process.py: Ctrl-C stops it at once); returns what the file holds: how many tensors of
    each type. llama.cpp keeps the routers, norms and biases as they are, and a tensor whose rows are not a multiple
    of its block (256 values for a k-quant) falls back to another type; the count says how many did."""
    _llama_cpp()
    if (problem := quantize_in_child(source, out, K_QUANTS[kind], threads)) or not out.is_file():
        raise UserError(f"{source}: {problem or 'llama.cpp wrote no file'}")
    return tensor_types(out)


def tensor_types(path_or_header: Path | GGUFHeader) -> str:
    """'12 Q4_K, 8 Q6_K, 30 F32, ...': the tensors of a GGUF file by type, most first (from its checked header)."""
    header = path_or_header if isinstance(path_or_header, GGUFHeader) else read_gguf_header(path_or_header)
    return header_tensor_types(header)
