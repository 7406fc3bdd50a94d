"""Speculative decoding with the MTP modules: greedy output identical to plain greedy decoding, sampled output with
the main model's distribution (the rejection rule, and end to end on a tiny vocabulary), and drafts that get
accepted on a model that learned something."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moe_lm.config import MTPConfig
from moe_lm.inference.generate import generate
from moe_lm.inference.sampling import Sampling
from moe_lm.inference.speculative import _Drafter, accept_or_resample, speculative_generate
from moe_lm.model import Transformer
from moe_lm.model.attention import KVCache
from moe_lm.testing import tiny_model_cfg
from moe_lm.train.objective import next_token_losses, total_loss


def markov_model(
    depth: int, vocab: int = 97, steps: int = 150, attention: str = "mla", seed: int = 0, n_layers: int = 3
) -> Transformer:
    """A tiny MTP model trained on a chain with two near-equally likely successors of each token (5t + 3 or 7t + 1
    mod V, 45 % each): the greedy choice between them is close for the main model and for the MTP modules alike,
    so the drafts are often, but not always, what the main model picks."""
    torch.manual_seed(seed)
    cfg = dataclasses.replace(
        tiny_model_cfg(attention, vocab_size=vocab, n_layers=n_layers), mtp=MTPConfig(depth=depth)
    )
    model = Transformer(cfg).train()
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        seq = np.zeros((8, 33), np.int64)
        seq[:, 0] = rng.integers(0, vocab, 8)
        for i in range(1, 33):
            u, prev = rng.random(8), seq[:, i - 1]
            seq[:, i] = np.where(u < 0.45, (5 * prev + 3) % vocab, (7 * prev + 1) % vocab)
            seq[:, i] = np.where(u < 0.9, seq[:, i], rng.integers(0, vocab, 8))
        batch = torch.from_numpy(seq)
        out = model(batch[:, :-1], mtp=True)
        ce, mtp = next_token_losses(out, batch[:, 1:])
        total_loss(ce, mtp, 1.0, out.aux_loss).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@pytest.fixture(scope="module")
def trained():
    # seed 1: depth 1's greedy drafts are rejected now and then (seed 0's all agree with the main model since the
    # attention took its fused kernel), so the roll-back after a rejection is exercised
    return {depth: markov_model(depth, seed=1) for depth in (1, 3)}  # ~3 s each


@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_speculative_decoding_is_plain_greedy_decoding(trained, depth):
    model = trained[depth]
    accepted = proposed = 0
    for prompt in ([1, 2, 3], [40], [7, 38, 96, 5, 28]):
        plain = generate(model, prompt, 50, Sampling(temperature=0), seed=0)
        spec, stats = speculative_generate(model, prompt, 50, Sampling(temperature=0), seed=0)
        assert spec == plain
        assert stats.rounds < len(plain)  # drafts were accepted: fewer main-model passes than tokens
        accepted, proposed = accepted + sum(stats.accepted), proposed + sum(stats.proposed)
    assert 0 < accepted < proposed  # and some rejected: the roll-back after a rejection was exercised


@pytest.mark.parametrize("depth", [1, 3])
def test_draft_caches_roll_back_to_what_a_fresh_pass_computes(trained, depth):
    """Greedy: each round's drafts must be what fresh full-sequence MTP passes give (d_k: depth k's argmax at the
    last position of the tokens so far followed by d_1 .. d_{k-1}); a stale cache entry after a rejection would
    change drafts, not the output. Replayed here without caches, the proposed and accepted counts are the same."""
    model = trained[depth]
    totals = [0, 0]  # accepted, proposed over the prompts: some drafts of each kind, so both paths were replayed
    for prompt in ([7, 38, 96, 5, 28], [1, 2, 3], [50, 60]):
        accepted, proposed = replay_greedy_drafts(model, prompt, 50, depth)
        totals = [totals[0] + sum(accepted), totals[1] + sum(proposed)]
    assert 0 < totals[0] < totals[1]


def replay_greedy_drafts(model, prompt: list[int], budget: int, depth: int) -> tuple[list[int], list[int]]:
    """Speculative greedy decoding's accepted and proposed counts per depth, checked against a replay without
    caches."""
    plain = generate(model, prompt, budget, Sampling(temperature=0), seed=0)
    _, stats = speculative_generate(model, prompt, budget, Sampling(temperature=0), seed=0)
    n, proposed, accepted = 1, [0] * depth, [0] * depth  # n: tokens of `plain` known so far
    while n < budget:
        drafts = []
        for k in range(1, min(depth, budget - n - 1) + 1):
            with torch.no_grad():
                out = model(torch.tensor([prompt + plain[:n] + drafts]), mtp=True)
            drafts.append(int(out.mtp_logits[k - 1][0, -1].argmax()))
        kept = 0
        for j, d in enumerate(drafts):
            proposed[j] += 1
            if d != plain[n + j]:
                break
            accepted[j] += 1
            kept += 1
        n += kept + 1
    assert (stats.proposed, stats.accepted) == (proposed, accepted)
    return accepted, proposed


def test_drafter_state_after_a_rejection_equals_a_fresh_pass(trained):
    """The drafts' distributions q_k after a partly rejected round equal those of fresh full-sequence MTP passes
    over the true tokens: the caches kept only positions whose inputs were all true."""
    model, sampling = trained[3], Sampling(temperature=1.0, top_k=0, top_p=1.0)
    gen = torch.Generator().manual_seed(0)

    def fresh(tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
        qs = []
        for k in range(1, len(drafts) + 1):
            with torch.no_grad():
                out = model(torch.tensor([tokens + drafts[: k - 1]]), mtp=True)
            qs.append(sampling.probs(out.mtp_logits[k - 1][0, -1]))
        return qs

    drafter = _Drafter(model, 3)
    tokens = [7, 38, 96, 5, 28, 40]
    for accepted in (1, 0, 2):  # a round keeping d_1 only, then none, then d_1 and d_2
        with torch.no_grad():
            h0 = model(torch.tensor([tokens[:-1]])).hidden[0]
            drafts, qs = drafter.propose(tokens, h0, 3, sampling, gen)
        for got, want in zip(qs, fresh(tokens, drafts), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        replacement = (drafts[accepted] + 1) % 97  # the main model's token where the draft was rejected
        drafter.keep_true(len(tokens) - 1 + accepted)
        tokens = tokens + drafts[:accepted] + [replacement]


def test_greedy_equality_with_gqa_and_fewer_draft_modules():
    model = markov_model(2, attention="gqa", steps=100)
    plain = generate(model, [3, 18], 40, Sampling(temperature=0), seed=0)
    for depth in (1, 2):
        assert speculative_generate(model, [3, 18], 40, Sampling(temperature=0), seed=0, depth=depth)[0] == plain


def test_budget_and_context_end_are_respected(trained):
    model = trained[3]
    for n in (1, 2, 3, 5):
        assert len(speculative_generate(model, [1], n, Sampling(temperature=0), seed=0)[0]) == n
    prompt = list(range(60))  # max_seq_len 64: room for 4 tokens
    out, _ = speculative_generate(model, prompt, 50, Sampling(temperature=0), seed=0)
    assert out == generate(model, prompt, 50, Sampling(temperature=0), seed=0) and len(out) == 4


def test_rejection_rule_keeps_the_target_distribution():
    """Drafts from q, the rule applied: the tokens come out distributed as p (200k draws, 6 tokens)."""
    p = torch.tensor([0.05, 0.4, 0.1, 0.0, 0.25, 0.2])
    q = torch.tensor([0.3, 0.1, 0.1, 0.3, 0.1, 0.1])
    gen = torch.Generator().manual_seed(0)
    n = 100_000
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).tolist()
    counts = np.zeros(6)
    accepted = 0
    for d in drafts:
        ok, token = accept_or_resample(p, q, d, gen)
        counts[token] += 1
        accepted += ok
    freq = counts / n
    np.testing.assert_allclose(freq, p.numpy(), atol=4 * np.sqrt(0.25 / n))  # 4 standard errors at most
    assert abs(accepted / n - torch.minimum(p, q).sum().item()) < 0.01  # acceptance rate = sum min(p, q)
    # one-hot p and q (greedy): a draft is kept iff it is p's argmax, else p's argmax replaces it
    one = torch.eye(6)
    assert accept_or_resample(one[4], one[4], 4, gen) == (True, 4)
    assert accept_or_resample(one[4], one[2], 2, gen) == (False, 4)


def test_sampled_speculative_decoding_has_the_main_models_distribution():
    """The first two of three tokens after a prompt on an 8-token vocabulary (x2 is drafted by MTP and accepted or
    resampled): their empirical joint distribution under speculative sampling (temperature 1.5, top-k 6) matches the
    main model's exact p(x1) p(x2 | x1), computed by enumeration."""
    # seed 4: a model whose MTP drafts are rejected often enough (~6 %) for the resampling path to weigh in the test;
    # two layers (a dense and an MoE one): the 3,000 generations cost two thirds of what the three-layer model's do
    model = markov_model(1, vocab=8, steps=60, seed=4, n_layers=2)
    sampling = Sampling(temperature=1.5, top_k=6, top_p=1.0)
    prompt = [3, 2]
    with torch.no_grad():
        p1 = sampling.probs(model(torch.tensor([prompt])).logits[0, -1])
        exact = torch.stack(
            [p1[a] * sampling.probs(model(torch.tensor([prompt + [a]])).logits[0, -1]) for a in range(8)]
        )
    n = 3000
    counts = np.zeros((8, 8))
    accepted = 0
    for seed in range(n):
        (a, b, _), stats = speculative_generate(model, prompt, 3, sampling, seed=seed)
        counts[a, b] += 1
        accepted += stats.accepted[0]
    expected = exact.numpy() * n
    cells = expected > 5
    chi2 = (((counts - expected) ** 2)[cells] / expected[cells]).sum()
    assert counts[~cells].sum() <= 5 * max(1, expected[~cells].sum())
    assert chi2 < 100, chi2  # ~ chi-square with < 48 degrees of freedom: P(> 100) < 1e-5
    assert 0.05 < accepted / n < 0.97  # the rule was exercised both ways (at least 90 drafts resampled)


def test_kv_cache_truncate_then_extend_matches_a_fresh_cache(trained):
    model = trained[1]
    tokens = torch.tensor([[5, 28, 46, 43, 24, 29]])
    cache = KVCache()
    model(tokens[:, :4], cache=cache)
    model(torch.tensor([[9, 9]]), cache=cache)  # two positions of a rejected continuation
    cache.truncate(4)
    got = model(tokens[:, 4:], cache=cache).logits
    want = model(tokens).logits[:, 4:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_speculative_decoding_needs_mtp_modules():
    model = Transformer(tiny_model_cfg()).eval()
    with pytest.raises(ValueError, match="model.mtp.depth"):
        speculative_generate(model, [1, 2], 5, Sampling(0), seed=0)
    with pytest.raises(ValueError, match="1..1"):
        speculative_generate(markov_model(1, steps=1), [1, 2], 5, Sampling(0), seed=0, depth=2)
