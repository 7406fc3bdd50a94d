"""Serving check: exports served by vLLM (its CPU build) give our model's prompt logprobs.

    make serve-check                                                      # sets up .venv-vllm, then runs:
    .venv/bin/python launch/serve_check.py --vllm-python .venv-vllm/bin/python [--out DIR] [--cases mla gqa ...]

Two halves in two interpreters, so the project's dependencies and vLLM's stay apart:
- the project half (this interpreter, the project's .venv) builds small MLA and GQA models, each with plain RoPE,
  with YaRN, and pruned to half its routed experts (CASES), exports each with `export_hf` (DeepseekV3ForCausalLM /
  Glm4MoeForCausalLM; a pruned case's export then pruned by `moe-lm prune`'s transformers writer) and computes our
  logprob of every prompt token (a pruned case: of the model pruned in memory by the same plan);
- the serving half (`--serve DIR`, run by --vllm-python; it imports only vllm) loads the export in `vllm.LLM`,
  feeds the same token ids and writes vLLM's prompt logprobs.
The project half then compares: the largest |our logprob - vLLM's| over all prompt tokens must be <= --tol.
It also prints how far off an engine with the other rotary pairing would be, so a pass means something.

vLLM on CPU needs two settings for DeepSeek-V3 models, both set here for the serving half:
- VLLM_MLA_DISABLE=1: the CPU MLA kernel takes only the published head sizes; the MHA path reads the same
  weights and uses the same rotary code;
- compilation_config custom_ops "-rotary_embedding": vLLM 0.32's CPU rotary kernel mis-rotates a strided query
  slice (DeepSeek's q_pe on the MHA path); the native torch rotary has the same layout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# why only the standard library at module level: the serving half runs in the vLLM venv, which has no moe_lm.

PROMPTS = 4  # prompts per model (as moe_lm/testing.py; repeated: the serving half has no moe_lm)
PROMPT_LEN = 40


# case -> (attention, YaRN or not, pruned or not); YaRN with an original context shorter than the prompts, so it
# matters; pruned: the export pruned by `moe-lm prune`'s transformers writer to half its routed experts, ungrouped
CASES = {"mla": ("mla", False, False), "gqa": ("gqa", False, False), "mla-yarn": ("mla", True, False),
         "gqa-yarn": ("gqa", True, False), "mla-pruned": ("mla", False, True), "gqa-pruned": ("gqa", False, True)}
NAMES = {"mla": "DeepseekV3 (MLA)", "gqa": "Glm4Moe (GQA)"}


def prepare_case(case: str, out_dir: Path) -> dict:
    """Export the check model of `case` (a CASES key) into out_dir and write out_dir/expected.json (prompts, our
    logprobs, the other-pairing logprobs); returns that record."""
    from moe_lm.interop.hf import export_hf
    from moe_lm.testing import (
        check_model,
        check_prompts,
        prompt_logprobs,
        wrong_layout_logprobs,
    )

    attention, yarn, pruned = CASES[case]
    model = check_model(attention, yarn)
    if pruned:
        model = pruned_export(model, out_dir)
    else:
        export_hf(model, out_dir)
    prompts = check_prompts(model.cfg.vocab_size)
    record = {
        "case": case,
        "prompts": prompts,
        "ours": prompt_logprobs(model, prompts),
        "wrong_layout": wrong_layout_logprobs(model, prompts),
    }
    (out_dir / "expected.json").write_text(json.dumps(record))
    return record


def pruned_export(model, out_dir: Path):
    """`model` exported beside out_dir, then pruned into out_dir by prune's transformers writer to half its routed
    experts (a seeded plan), routed without expert groups (`--ungroup`: its 4 groups of 2 keep their groups only
    whole); returns the model pruned in memory by the same plan (moe_lm/pruning/pruned.py), whose logprobs vLLM's
    must give."""
    import numpy as np

    from moe_lm.config import Config, TrainConfig
    from moe_lm.interop.hf import export_hf
    from moe_lm.pruning.hf_folder import prune_hf_folder
    from moe_lm.pruning.plan import KeepPlan
    from moe_lm.pruning.pruned import decoder_moe_layers, pruned_model

    moe, rng = model.cfg.moe, np.random.default_rng(0)
    scores = {layer: rng.random(moe.n_routed_experts) for layer in decoder_moe_layers(model)}
    plan = KeepPlan.from_scores(scores, moe.n_routed_experts // 2, 1)
    source = out_dir.with_name(f"{out_dir.name}-source")
    export_hf(model, source)
    prune_hf_folder(source, out_dir, plan.kept, ungroup=True)
    return pruned_model(model, Config(model=model.cfg, train=TrainConfig(seq_len=model.cfg.max_seq_len)), plan)


def vllm_env() -> dict[str, str]:
    """The serving half's environment: the CPU settings above, a small KV cache (GiB)."""
    env = dict(os.environ)
    env.setdefault("VLLM_MLA_DISABLE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def serve(export_dir: Path) -> None:
    """The serving half: vLLM's prompt logprobs for expected.json's prompts, into export_dir/served.json."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads((export_dir / "expected.json").read_text())["prompts"]
    llm = LLM(
        model=str(export_dir),
        dtype="float32",
        skip_tokenizer_init=True,  # the check exports carry no tokenizer
        max_model_len=PROMPT_LEN + 8,
        max_num_seqs=PROMPTS,
        enforce_eager=True,
        compilation_config={"custom_ops": ["all", "-rotary_embedding"]},
    )
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    served = []
    for prompt, out in zip(prompts, outputs, strict=True):
        # entry 0 is None (no context); entry i maps token ids to Logprob, the prompt's own token among them
        served.append([out.prompt_logprobs[i][tok].logprob for i, tok in enumerate(prompt) if i > 0])
    (export_dir / "served.json").write_text(json.dumps({"served": served}))
    # why stop the engine and leave at once: at interpreter exit vLLM 0.32's CPU build sometimes aborts
    # ("terminate called without an active exception", exit 134) after the work is done
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_check(out: Path, vllm_python: str, cases: list[str], tol: float) -> dict[str, dict]:
    """Export, serve and compare each case; {case: {gap, wrong_layout_gap, serve_s, ok}} (gap inf: vLLM failed)."""
    from moe_lm.testing import max_abs_gap

    results = {}
    for case in cases:
        case_dir = out / case
        record = prepare_case(case, case_dir)
        start = time.perf_counter()
        cmd = [vllm_python, str(Path(__file__).resolve()), "--serve", str(case_dir)]
        proc = subprocess.run(cmd, env=vllm_env(), capture_output=True, text=True)
        serve_s = time.perf_counter() - start
        wrong = max_abs_gap(record["ours"], record["wrong_layout"])
        if proc.returncode != 0:
            print(f"--- vLLM failed on {case} (exit {proc.returncode}); its last output:", file=sys.stderr)
            print(proc.stderr[-6000:], file=sys.stderr)
            gap = math.inf
        else:
            gap = max_abs_gap(record["ours"], json.loads((case_dir / "served.json").read_text())["served"])
        results[case] = {"gap": gap, "wrong_layout_gap": wrong, "serve_s": serve_s, "ok": gap <= tol}
    return results


def report(results: dict[str, dict], tol: float) -> str:
    """The table main prints: per case, the largest gap to vLLM and to the other rotary pairing."""
    lines = [f"{'export':<28} {'max |Δ logprob|':>15} {'other pairing':>13} {'vLLM s':>6}  result"]
    for case, r in results.items():
        attention, yarn, pruned = CASES[case]
        name = NAMES[attention] + (" + YaRN" if yarn else "") + (" pruned" if pruned else "")
        verdict = "ok" if r["ok"] else ("vLLM failed" if math.isinf(r["gap"]) else f"MISMATCH (tol {tol:g})")
        lines.append(f"{name:<28} {r['gap']:>15.2e} {r['wrong_layout_gap']:>13.2e} {r['serve_s']:>6.0f}  {verdict}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="the interpreter that has vllm-cpu")
    ap.add_argument("--out", help="folder for the exports and logprobs (default: a temporary one)")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--tol", type=float, default=1e-3, help="largest allowed |our logprob - vLLM's|")
    ap.add_argument("--serve", metavar="DIR", help=argparse.SUPPRESS)  # the serving half (internal)
    args = ap.parse_args()
    if args.serve:
        serve(Path(args.serve))
        return
    if not Path(args.vllm_python).exists():
        sys.exit(f"error: no {args.vllm_python}; `make serve-check` sets up .venv-vllm with vllm-cpu")
    with tempfile.TemporaryDirectory() as tmp:
        results = run_check(Path(args.out or tmp), args.vllm_python, args.cases, args.tol)
    print(report(results, args.tol))
    if not all(r["ok"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
