"""TriAttention (arXiv:2604.04921): Eqs. 10-11 against a brute-force computation, the ranking of a head
whose queries sit at their centre, the calibration, and the method end to end on SmolLM2.

The references here apply RoPE with explicit cos/sin rotations of real vectors, one query and
one key at a time; they never call the method's own helpers."""

from __future__ import annotations

import math

import pytest
import torch

from kvsieve import GenerateConfig, SieveCache, generate
from kvsieve.cache import SieveCache as Cache
from kvsieve.methods import make_policy
from kvsieve.methods.triattention import QueryStats, StatsModelError
from kvsieve.schedule import compress_layer

B, HKV, G, D = 2, 2, 3, 8
HQ, F = HKV * G, D // 2
SHORT = "What is 7 times 8?"
LONG = ("Here is a short story. A fox lived near a river and every morning it walked to the water "
        "to drink. One day the river was frozen, so the fox had to find another way to drink.")


def rope(x: torch.Tensor, position: float, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """RoPE of one real vector x [D] (rotate-half layout), as transformers applies it: float64."""
    x = x.double()
    half = x.shape[-1] // 2
    angle = position * inv_freq.double()
    cos, sin = angle.cos() * scaling, angle.sin() * scaling
    return torch.cat([x[:half] * cos - x[half:] * sin, x[half:] * cos + x[:half] * sin])


def random_stats(seed=0, layers=1, scaling=1.0, spread=True, **fields) -> QueryStats:
    g = torch.Generator().manual_seed(seed)
    q_mean = torch.randn(layers, HQ, F, 2, generator=g)
    q_abs = q_mean.norm(dim=-1) * (1 + torch.rand(layers, HQ, F, generator=g) if spread else 1)
    inv_freq = 10000.0 ** -(torch.arange(0, D, 2, dtype=torch.float64) / D)
    return QueryStats(q_mean=q_mean, q_abs_mean=q_abs, inv_freq=inv_freq, attention_scaling=scaling,
                      num_kv_heads=HKV, model_name=fields.get("model_name", "synthetic"),
                      fingerprint=fields.get("fingerprint", {}), settings={})


def saved(stats: QueryStats, tmp_path, name="stats.pt") -> str:
    path = tmp_path / name
    stats.save(path)
    return str(path)


def cache_of(pre_keys: torch.Tensor, positions: torch.Tensor, stats: QueryStats) -> Cache:
    """A one-layer cache holding the post-RoPE keys of pre-RoPE keys [B, HKV, T, D] at positions [B, T]."""
    post = torch.stack([torch.stack([torch.stack([rope(pre_keys[b, h, t], float(positions[b, t]), stats.inv_freq,
                                                       stats.attention_scaling) for t in range(positions.shape[1])])
                                     for h in range(HKV)]) for b in range(B)]).float()
    cache = Cache(1)
    cache.begin_step(positions)
    cache.update(post, torch.randn_like(post), 0)
    return cache


def brute_force(pre_keys, positions, seen, stats: QueryStats, offset_max: int, layer: int = 0) -> torch.Tensor:
    """[B, HKV, G, T] Eqs. 10-11 one key and one query head at a time: the centre query rotated to t + o,
    dotted with the key rotated to its position, averaged over o in {1, 2, 4, ..., offset_max},
    plus s^2 sum_f (E|q_f| - |q_bar_f|) |k_f| from the pre-RoPE key's pairs (statistics of ``layer``)."""
    offsets = [2 ** i for i in range(int(math.log2(offset_max)) + 1)]
    s = stats.attention_scaling
    out = torch.zeros(B, HKV, G, positions.shape[1], dtype=torch.float64)
    for b in range(B):
        for h in range(HKV):
            for g in range(G):
                centre = stats.q_mean[layer, h * G + g]  # [F, 2]
                q_bar = torch.cat([centre[:, 0], centre[:, 1]])  # [D] real layout
                spread = stats.q_abs_mean[layer, h * G + g].double() - centre.double().norm(dim=-1)
                for t in range(positions.shape[1]):
                    k = pre_keys[b, h, t]
                    k_post = rope(k, float(positions[b, t]), stats.inv_freq, s)
                    trig = sum(float(rope(q_bar, float(seen[b] + o), stats.inv_freq, s) @ k_post)
                               for o in offsets) / len(offsets)
                    pair_norm = torch.stack([k[:F], k[F:]]).double().norm(dim=0)  # |k_f|
                    out[b, h, g, t] = trig + s * s * float(spread @ pair_norm)
    return out


@pytest.mark.parametrize("offset_max,scaling", [(65536, 1.0), (8, 1.3)])
def test_series_score_equals_a_brute_force_computation_from_the_centres(tmp_path, offset_max, scaling):
    stats = random_stats(seed=1, scaling=scaling)
    pre = torch.randn(B, HKV, 7, D, generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 9, 20, 41, 42, 77, 200]])
    seen = torch.tensor([7, 230])
    cache = cache_of(pre, positions, stats)
    ref = brute_force(pre, positions, seen, stats, offset_max)  # [B, HKV, G, T]
    path = saved(stats, tmp_path)
    raw = make_policy("triattention", 4, stats=path, normalize=False, offset_max=offset_max).scorer
    torch.testing.assert_close(raw.score(cache.layers[0], seen)[..., :7].double(), ref.amax(dim=2),
                               rtol=1e-4, atol=1e-4)
    # z-normalised per query head over the live tokens (population std), then the group max
    z = (ref - ref.mean(dim=-1, keepdim=True)) / ref.std(dim=-1, unbiased=False, keepdim=True)
    normalised = make_policy("triattention", 4, stats=path, offset_max=offset_max).scorer
    torch.testing.assert_close(normalised.score(cache.layers[0], seen)[..., :7].double(), z.amax(dim=2),
                               rtol=1e-4, atol=1e-4)
    shared = make_policy("triattention", 4, stats=path, offset_max=offset_max, pruning="per_layer").scorer
    expected = z.amax(dim=2).amax(dim=1, keepdim=True).expand(B, HKV, 7)
    torch.testing.assert_close(shared.score(cache.layers[0], seen)[..., :7].double(), expected, rtol=1e-4, atol=1e-4)


def test_a_head_whose_queries_sit_at_their_centre_ranks_distances_as_its_attention_does(tmp_path):
    """Every query of a head at its centre (E|q_f| = |q_bar_f|: no norm term; the group's heads share
    it) and one future query (offset 1): each key's score is that query's logit, so the keys, one
    key vector at every distance, rank as the query's softmax attention ranks them."""
    stats = random_stats(seed=3, spread=False)
    stats.q_mean = stats.q_mean[:, ::G].repeat_interleave(G, dim=1)  # one centre per kv head's group
    stats.q_abs_mean = stats.q_mean.norm(dim=-1)
    T = 40
    key = torch.randn(D, generator=torch.Generator().manual_seed(4))
    pre = key.expand(B, HKV, T, D).contiguous()
    positions = torch.arange(T).expand(B, T)
    seen = torch.tensor([T, T])
    cache = cache_of(pre, positions, stats)
    scorer = make_policy("triattention", 4, stats=saved(stats, tmp_path), offset_max=1, normalize=False).scorer
    scores = scorer.score(cache.layers[0], seen)[..., :T]  # [B, HKV, T]
    for h in range(HKV):
        centre = torch.cat([stats.q_mean[0, h * G, :, 0], stats.q_mean[0, h * G, :, 1]])
        query = rope(centre, T + 1, stats.inv_freq, 1.0)  # the query at t + 1, t = T the next position
        attention = torch.stack([query @ rope(key, t, stats.inv_freq, 1.0) for t in range(T)]).softmax(dim=0)
        distance_order = (T + 1 - attention.argsort(descending=True)).tolist()  # distances, most attended first
        for b in range(B):
            assert (T + 1 - scores[b, h].argsort(descending=True)).tolist() == distance_order


def test_compress_layer_keeps_the_top_scores_per_head_and_every_protected_token(tmp_path):
    stats = random_stats(seed=5)
    T = 12
    pre = torch.randn(B, HKV, T, D, generator=torch.Generator().manual_seed(6))
    positions = torch.arange(T).expand(B, T)
    seen = torch.tensor([T, T])
    cache = cache_of(pre, positions, stats)
    policy = make_policy("triattention", 6, stats=saved(stats, tmp_path), recent=2, pin_prompt=False,
                         pruning="per_layer_per_head")
    scores = policy.scorer.score(cache.layers[0], seen)[..., :T].clone()
    compress_layer(cache.layers[0], policy, 6, seen)
    layer = cache.layers[0]
    for b in range(B):
        for h in range(HKV):
            kept = set(layer.meta["pos"][b, h, :int(layer.lengths[b, h])].tolist())
            ranked = [p for p in scores[b, h].argsort(descending=True).tolist() if p < T - 2]
            assert kept == {T - 2, T - 1, *ranked[:4]}


def test_settings_are_checked_and_the_official_defaults_hold(tmp_path):
    path = saved(random_stats(), tmp_path)
    with pytest.raises(ValueError, match="stats=FILE"):
        make_policy("triattention", 64)
    with pytest.raises(ValueError, match="does not exist"):
        make_policy("triattention", 64, stats=str(tmp_path / "missing.pt"))
    (tmp_path / "junk.pt").write_text("not a tensor file")
    with pytest.raises(ValueError, match="not a TriAttention statistics file"):
        make_policy("triattention", 64, stats=str(tmp_path / "junk.pt"))
    with pytest.raises(ValueError, match="normalize_over must be one of"):
        make_policy("triattention", 64, stats=path, normalize_over="prompt")
    # per_head keeps the same tokens in every layer: one budget per layer, the prompt read whole
    with pytest.raises(ValueError, match="allocator 'pyramid' gives layers or heads different budgets"):
        make_policy("triattention", 64, stats=path, allocator="pyramid")
    with pytest.raises(ValueError, match="set prefill_block false"):
        make_policy("triattention", 64, stats=path, prefill_block=True)
    with pytest.raises(ValueError, match="set one false"):
        make_policy("triattention", 64, stats=path, pin_prompt=True, protect_prompt=True)
    # the official runner's semantics (scripts/worker.py): prompt inside the budget, no window, every 128
    policy = make_policy("triattention", 512, stats=path)
    assert (policy.recent, policy.sinks, policy.interval, policy.pin_prompt, policy.protect_prompt,
            policy.compress_prefill) == (0, 0, 128, True, False, False)
    assert policy.scorer.pruning == "per_head" and policy.scorer.needs.cross_layer
    assert policy.settings()["pin_prompt"] is True
    # kvsieve's earlier reading, as options: protecting the prompt unpins it
    earlier = make_policy("triattention", 128, stats=path, protect_prompt=True, recent=64, pruning="per_layer_per_head")
    assert (earlier.pin_prompt, earlier.protect_prompt, earlier.recent, earlier.scorer.needs.cross_layer) == (
        False, True, 64, False)
    assert "pin_prompt" not in earlier.settings()  # settings recorded before pin_prompt existed still compare equal


def official_keep(refs: list[torch.Tensor], prompt_len: list[int], budget: int, per_head: bool,
                  decode_only: bool = True) -> list[list[list[set]]]:
    """Kept positions [layer][row][kv head] by the official runner's rule, from brute-force scores
    ``refs`` [L] x [B, HKV, G, T] of keys at positions 0..T-1: the prompt kept inside the budget (its
    first ``budget`` positions if longer), each (layer, query head) z-scored over the generated tokens
    (population std), the max over each query group, with ``per_head`` the mean of those over layers,
    then the top ``budget - prompt`` generated tokens per kv head (compute_keep_indices)."""
    L, T = len(refs), refs[0].shape[-1]
    out = [[[set() for _ in range(HKV)] for _ in range(B)] for _ in range(L)]
    for b in range(B):
        P = prompt_len[b]
        if P >= budget:
            for l in range(L):
                for h in range(HKV):
                    out[l][b][h] = set(range(budget))
            continue
        per_layer = []
        for ref in refs:
            x = ref[b]  # [HKV, G, T]
            span = x[..., P:] if decode_only else x
            z = (x - span.mean(dim=-1, keepdim=True)) / span.std(dim=-1, unbiased=False, keepdim=True)
            per_layer.append(z.amax(dim=1))  # [HKV, T]
        chosen = [torch.stack(per_layer).mean(dim=0)] * L if per_head else per_layer
        for l in range(L):
            for h in range(HKV):
                decode = chosen[l][h, P:]
                top = decode.topk(budget - P).indices + P
                out[l][b][h] = set(range(P)) | set(top.tolist())
    return out


@pytest.mark.parametrize("pruning,normalize_over", [("per_head", "decode"), ("per_layer_per_head", "decode"),
                                                    ("per_head", "live")])
def test_the_schedule_keeps_what_the_official_runner_keeps(tmp_path, pruning, normalize_over):
    """Three layers, two rows whose prompts are shorter and longer than the budget: the kept positions of
    every (layer, row, kv head) equal the official rule's (``official_keep``) from brute-force scores."""
    from kvsieve.schedule import Schedule

    L, T, budget, prompt_len = 3, 14, 8, [5, 9]
    stats = random_stats(seed=7, layers=L)
    g = torch.Generator().manual_seed(8)
    pre = [torch.randn(B, HKV, T, D, generator=g) for _ in range(L)]
    positions = torch.arange(T).expand(B, T)
    seen = torch.tensor([T, T])
    cache = Cache(L)
    cache.begin_step(positions)
    for l in range(L):
        post = torch.stack([torch.stack([torch.stack([rope(pre[l][b, h, t], float(t), stats.inv_freq, 1.0)
                                                      for t in range(T)]) for h in range(HKV)]) for b in range(B)])
        cache.update(post.float(), torch.randn_like(post).float(), l)
    policy = make_policy("triattention", budget, stats=saved(stats, tmp_path), pruning=pruning,
                         normalize_over=normalize_over)
    schedule = Schedule(policy, cache, horizon=64)
    schedule.record_prompt(torch.tensor(prompt_len))
    cache.set_seen(seen)
    assert schedule.compress()
    refs = [brute_force(pre[l], positions, seen, stats, 65536, layer=l) for l in range(L)]
    expected = official_keep(refs, prompt_len, budget, per_head=pruning == "per_head",
                             decode_only=normalize_over == "decode")
    for l, layer in enumerate(cache.layers):
        assert layer.lengths.eq(budget).all()
        kept = [[set(layer.meta["pos"][b, h, :budget].tolist()) for h in range(HKV)] for b in range(B)]
        assert kept == expected[l], f"layer {l}"
    if pruning == "per_head":  # the same tokens in every layer
        assert expected[0] == expected[1] == expected[2]


# ---------------------------------------------------------------------------- on SmolLM2
@pytest.fixture(scope="module")
def smol_stats(smollm, tmp_path_factory):
    """Statistics of the bundled model from a few GSM8K-like lines (seconds)."""
    from kvsieve.analysis.qk import calibrate

    model, tok = smollm
    texts = ["Natalia sold 48/2 = 24 clips in May. Natalia sold 48+24 = 72 clips altogether. #### 72",
             "Weng earns 12/60 = $0.2 per minute. Working 50 minutes, she earned 0.2 x 50 = $10. #### 10",
             "The fox crossed the frozen river at dawn and drank from a hole in the ice."]
    path = tmp_path_factory.mktemp("tri") / "smol.pt"
    calibrate(model, tok, texts * 4, tokens=256, chunk=128).save(path)
    return str(path)


def test_calibration_centres_are_the_mean_pre_rope_query_of_each_head(smollm):
    """SmolLM2 (Llama: no q norm) feeds q_proj's output to RoPE: the calibrated centre and mean norm
    of each pair equal those of the q_proj outputs, read by a forward hook."""
    from kvsieve.analysis.qk import calibrate

    model, tok = smollm
    text = "Weng earns 12/60 = $0.2 per minute. Working 50 minutes, she earned 0.2 x 50 = $10."
    outputs = {}
    layers = model.model.layers
    hooks = [layers[i].self_attn.q_proj.register_forward_hook(
        lambda mod, args, out, i=i: outputs.setdefault(i, out.detach())) for i in (0, 7)]
    try:
        stats = calibrate(model, tok, [text], tokens=64, chunk=64)
    finally:
        for h in hooks:
            h.remove()
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    for i, out in outputs.items():
        q = out[0].view(out.shape[1], -1, head_dim).double()  # [T, HQ, D]
        pairs = torch.complex(q[..., : head_dim // 2], q[..., head_dim // 2:])
        torch.testing.assert_close(stats.q_mean[i, ..., 0].double(), pairs.mean(0).real, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(stats.q_mean[i, ..., 1].double(), pairs.mean(0).imag, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(stats.q_abs_mean[i].double(), pairs.abs().mean(0), rtol=1e-3, atol=1e-4)
    assert stats.settings["tokens"] == len(tok(text).input_ids)


def run(smollm, prompts, policy, n=24):
    model, tok = smollm
    return generate(model, tok, prompts, policy, GenerateConfig(max_new_tokens=n))


def test_budget_at_least_the_length_reproduces_full(smollm, full_greedy, smol_stats):
    full = full_greedy([SHORT, LONG], 24)
    ours = run(smollm, [SHORT, LONG], make_policy("triattention", 4096, stats=smol_stats))
    assert ours.token_ids == full.token_ids
    assert all(s.compression_events == 0 for s in ours.stats)


@pytest.mark.parametrize("pruning", ["per_head", pytest.param("per_layer_per_head", marks=pytest.mark.slow),
                                     pytest.param("per_layer", marks=pytest.mark.slow)])
def test_a_left_padded_batch_gives_each_row_its_own_output(smollm, smol_stats, pruning):
    """Compressing (budget 16, prompt competing), a row's tokens do not depend on its batch mate or padding."""
    policy = make_policy("triattention", 16, stats=smol_stats, pruning=pruning, pin_prompt=False)
    both = run(smollm, [SHORT, LONG], policy, n=30)
    alone = run(smollm, [SHORT], policy, n=30)
    assert both.token_ids[0] == alone.token_ids[0]
    assert all(s.compression_events > 0 for s in both.stats)


def test_transformers_generate_keeps_the_tokens_of_kvsieve_generate(smollm, smol_stats):
    model, tok = smollm
    prompts = ["The capital of France is", "Count: one, two, three, four, five, six, seven, eight"]
    ref = generate(model, tok, prompts, make_policy("triattention", 12, stats=smol_stats),
                   GenerateConfig(max_new_tokens=28, chat_template=False))
    assert sum(s.compression_events for s in ref.stats) > 0
    previous = model.config._attn_implementation
    try:
        cache = SieveCache.for_model(model, "triattention", 12, stats=smol_stats)
        enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
        out = model.generate(**enc, cache=cache, max_new_tokens=28, do_sample=False)
    finally:
        model.set_attn_implementation(previous)
    eos = tok.eos_token_id
    rows = [row[: row.index(eos) + 1] if eos in row else row for row in out[:, enc.input_ids.shape[1]:].tolist()]
    assert rows == ref.token_ids


def test_statistics_of_another_model_are_refused_naming_both(smollm, smol_stats, tmp_path):
    model, tok = smollm
    other = QueryStats.read(smol_stats)
    other.model_name, other.fingerprint = "Qwen2.5-Coder-1.5B-Instruct", {**other.fingerprint, "hidden_size": 1536}
    path = saved(other, tmp_path, "other.pt")
    with pytest.raises(StatsModelError, match="built for Qwen2.5-Coder-1.5B-Instruct .*not for smollm2-135m"):
        run(smollm, [SHORT], make_policy("triattention", 16, stats=path), n=4)
    previous = model.config._attn_implementation
    try:
        with pytest.raises(StatsModelError, match="were built for Qwen2.5"):
            SieveCache.for_model(model, "triattention", 16, stats=path)
    finally:
        model.set_attn_implementation(previous)


# ---------------------------------------------------------------------------- the analysis and the commands
def test_the_predicted_preference_is_the_centre_query_at_distance_d_dotted_with_the_centre_key():
    from kvsieve.analysis.qk import predicted_preference

    stats = random_stats(seed=7, scaling=1.2)
    g = torch.Generator().manual_seed(8)
    q, k = torch.randn(1, 2, F, dtype=torch.complex128, generator=g), torch.randn(1, 2, F, dtype=torch.complex128,
                                                                                    generator=g)
    got = predicted_preference(q, k, stats.inv_freq, 1.2, torch.arange(6))  # [1, 2, 6]
    for h in range(2):
        q_real, k_real = torch.cat([q[0, h].real, q[0, h].imag]), torch.cat([k[0, h].real, k[0, h].imag])
        ref = [float(rope(q_real, 10 + d, stats.inv_freq, 1.2) @ rope(k_real, 10, stats.inv_freq, 1.2))
               for d in range(6)]
        assert got[0, h].tolist() == pytest.approx(ref, rel=1e-9, abs=1e-9)


def test_calibrate_and_analyze_commands_write_their_files_and_refuse_bad_data(smollm, tmp_path):
    import json

    from typer.testing import CliRunner

    from kvsieve.cli import app

    data = tmp_path / "gsm.jsonl"
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(30)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    runner = CliRunner()
    stats = tmp_path / "stats.pt"
    result = runner.invoke(app, ["calibrate", "triattention", "--data", str(data), "--out", str(stats),
                                 "--tokens", "256", "--chunk", "128"])
    assert result.exit_code == 0, result.output
    assert "256 tokens" in result.output
    saved = QueryStats.read(stats).check(smollm[0])
    assert saved.q_mean.shape == (30, 9, 32, 2) and saved.settings["tokens"] == 256
    result = runner.invoke(app, ["generate", "--method", "triattention", "--budget", "16", "--set", f"stats={stats}",
                                 "--max-new-tokens", "4", "Hi"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "qk"
    result = runner.invoke(app, ["analyze", "qk", "--data", str(data), "--out", str(out), "--tokens", "256",
                                 "--chunk", "128", "--max-distance", "32"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "qk.json").read_text())
    assert len(summary["heads"]) == 30 * 9 and len(summary["heads"][0]["measured_logit"]) == 33
    assert all(-1 <= h["correlation"] <= 1 and 0 <= h["q_concentration"] <= 1 for h in summary["heads"])
    assert (out / "qk.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.jsonl").write_text('{"question": "ok"}\nnot json\n')
    for args, message in ((["--data", str(tmp_path / "none.jsonl")], "is not a file"),
                          (["--data", str(tmp_path / "bad.jsonl")], "bad.jsonl:2 is not a JSON line"),
                          (["--data", str(data), "--chunk", "1"], "chunk must be >= 2")):
        result = runner.invoke(app, ["calibrate", "triattention", "--out", str(tmp_path / "x.pt"), *args],
                               env={"COLUMNS": "250"})
        assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize("pruning", ["per_head", "per_layer_per_head"])
def test_a_tensor_parallel_workers_slice_scores_its_heads_as_the_whole_model_does(tmp_path, pruning):
    """vLLM splits query and kv heads over tensor-parallel workers in contiguous slices; a worker
    holds kv head p and its query group.  Its scorer (``for_heads``) scores that head's keys as the
    scorer of every head scores them there."""
    import dataclasses

    stats = random_stats(seed=7)
    T = 10
    pre = torch.randn(B, HKV, T, D, generator=torch.Generator().manual_seed(8))
    seen = torch.tensor([T, T])
    layer = cache_of(pre, torch.arange(T).expand(B, T), stats).layers[0].view()
    whole = make_policy("triattention", 6, stats=saved(stats, tmp_path), pruning=pruning).scorer
    scores = whole.score(layer, seen)  # [B, HKV, cap]
    for part in range(HKV):
        heads = slice(part, part + 1)
        mine = dataclasses.replace(layer, keys=layer.keys[:, heads], values=layer.values[:, heads],
                                   lengths=layer.lengths[:, heads],
                                   meta={name: t[:, heads] for name, t in layer.meta.items()})
        torch.testing.assert_close(whole.for_heads(part, HKV).score(mine, seen), scores[:, heads], rtol=0, atol=0)
    with pytest.raises(ValueError, match="do not split into 3 equal parts"):
        whole.for_heads(0, 3)
