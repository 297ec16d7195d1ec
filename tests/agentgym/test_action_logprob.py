"""rollout.action_logprob=renormalised: a constrained reply's log-prob is that of the distribution it
was drawn from, log pi(a|s) - log sum_c pi(c|s), in the sampler and in the trainer (value and
gradient against a brute-force computation, masked-token invariance, the sampler's stored value
recomputed by the trainer), through the batch types and the store."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentgym.batch import EpisodeBatch
from agentgym.chat import ChatFormatter
from agentgym.config import AlgorithmConfig, PipelineConfig, TrainerConfig
from agentgym.context import merge_segments
from agentgym.rollout.engines.hf import HFEngine
from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, run_episodes
from agentgym.training.action_logprob import renormalised_logprobs
from agentgym.training.batch import TrainBatch
from agentgym.training.forward import policy_forward
from agentgym.training.policy_trainer import PolicyTrainer
from agentgym.types import Episode
from batches import mask_runs  # tests/ is on sys.path
from env_adapters import make_env

T = 0.2  # a temperature other than 1 (the log-probs are those of logits / T), low enough that the
# randomly initialised tiny model's candidates differ by more than the tolerances


# -- the rule, closed form -----------------------------------------------------------------------
def _trie_conditionals(cands, lps, k):
    """Brute force: q(a_j | a_<j) = (mass of the candidates through a[:j+1]) / (mass through
    a[:j]), the last token's numerator the mass of the candidates equal to a."""
    a = cands[k]
    mass = [math.exp(sum(x)) for x in lps]
    out = []
    for j in range(len(a)):
        below = sum(m for c, m in zip(cands, mass) if c[:j] == a[:j] and len(c) >= j)
        if j + 1 < len(a):
            through = sum(m for c, m in zip(cands, mass) if c[:j + 1] == a[:j + 1])
        else:
            through = sum(m for c, m in zip(cands, mass) if c == a)
        out.append(math.log(through / below))
    return out


CANDIDATES = [[5, 6, 7, 2], [5, 6, 8, 2], [5, 9, 2], [5, 6, 7, 2, 4], [5, 6, 8, 2], [3, 2]]


@pytest.mark.parametrize("t", [1.0, 2.5, 0.5])
@pytest.mark.parametrize("k", range(len(CANDIDATES)))
def test_renormalised_logprobs_are_the_candidate_trie_conditionals(k, t):
    """At choice temperature t (rollout.action_temperature) the distribution is
    pi(a)^(1/t) / sum_c pi(c)^(1/t): the brute-force trie of the masses exp(log pi(c) / t)."""
    g = torch.Generator().manual_seed(k)
    node: dict[tuple, float] = {}  # log pi(c_j | c_<j): one value per prefix, as a model gives
    lps = [torch.tensor([node.setdefault(tuple(c[:j + 1]), -3 * float(torch.rand(1, generator=g)))
                         for j in range(len(c))], dtype=torch.float64) for c in CANDIDATES]
    got = renormalised_logprobs(CANDIDATES, lps, k, t)
    # the sum is the action-level renormalised log-prob (duplicates count for the reply they equal)
    same = [i for i, c in enumerate(CANDIDATES) if c == CANDIDATES[k]]
    want = torch.logsumexp(torch.stack([lps[i].sum() / t for i in same]), 0) - \
        torch.logsumexp(torch.stack([x.sum() / t for x in lps]), 0)
    assert float(got.sum()) == pytest.approx(float(want), abs=1e-12)
    assert got.tolist() == pytest.approx(_trie_conditionals(CANDIDATES, [(x / t).tolist() for x in lps], k), abs=1e-12)
    assert float(got[0]) <= 0 and all(float(x) <= 1e-12 for x in got)
    # the tempered choice's probabilities over the distinct candidates sum to 1
    distinct = {tuple(c): i for i, c in enumerate(CANDIDATES)}
    total = sum(math.exp(float(renormalised_logprobs(CANDIDATES, lps, i, t).sum())) for i in distinct.values())
    assert total == pytest.approx(1.0, abs=1e-12)


def test_a_choice_temperature_above_1_flattens_the_choice():
    cands = [[1, 2], [3], [1, 4, 5]]
    lps = [torch.tensor([-0.1, -0.2], dtype=torch.float64), torch.tensor([-3.0], dtype=torch.float64),
           torch.tensor([-0.1, -2.0, -1.0], dtype=torch.float64)]
    probs = {t: [math.exp(float(renormalised_logprobs(cands, lps, i, t).sum())) for i in range(3)] for t in (1.0, 3.0)}
    assert max(probs[3.0]) < max(probs[1.0]) and min(probs[3.0]) > min(probs[1.0])
    assert probs[1.0].index(max(probs[1.0])) == probs[3.0].index(max(probs[3.0]))  # greedy unchanged


def test_a_token_every_candidate_shares_gets_log_prob_zero():
    cands = [[1, 2, 3], [1, 2, 4], [1, 5]]
    lps = [torch.tensor([-0.5, -1.0, -2.0]), torch.tensor([-0.5, -1.0, -0.1]), torch.tensor([-0.5, -3.0])]
    got = renormalised_logprobs(cands, lps, 0)
    assert float(got[0]) == 0.0  # every candidate starts with token 1
    assert renormalised_logprobs([[1, 2]], [torch.tensor([-4.0, -2.0])], 0).tolist() == [0.0, 0.0]


# -- the trainer's forward against brute force -------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_path):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


def _rows(vocab: int, seed: int = 0) -> list[dict]:
    """Two conversations of several constrained turns each: candidates that share prefixes, one
    that extends the chosen reply, a duplicate, a turn with one candidate."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(6, vocab, (n,), generator=g).tolist()

    turns = [
        [[11, 12, 13, 3], [11, 12, 14, 3], [11, 15, 16, 3], [17, 18, 19, 3]],
        [[21, 22, 3], [21, 22, 3, 23], [24, 25, 3], [21, 22, 3]],  # 1 extends 0, 3 repeats it
        [[31, 3]],  # one candidate
        [[41, 42, 3], [41, 43, 3], [44, 45, 3]],
    ]
    plays = [[(0, 0), (1, 0), (2, 0)], [(3, 2), (1, 1)]]  # per row: (turn, the candidate chosen)
    rows = []
    for r, row_plays in enumerate(plays):
        ids = rand(5 + r)
        mask, starts, cands = [0] * len(ids), [], []
        for t, k in row_plays:
            starts.append(len(ids))
            cands.append(turns[t])
            ids += turns[t][k]
            mask += [1] * len(turns[t][k])
            obs = rand(3 + t)
            ids += obs
            mask += [0] * len(obs)
        rows.append({"input_ids": ids, "loss_mask": mask, "old_logprobs": [0.0] * len(ids),
                     "advantages": [0.0] * len(ids), "action_starts": starts, "action_candidates": cands})
    return rows


def _brute(model, row: dict) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Per turn: (start, length, the trainer-style per-token renormalised log-probs from the
    candidates scored one full forward each, the action-level log pi(a) - logsumexp_c log pi(c))."""
    out = []
    ids, mask = row["input_ids"], row["loss_mask"]
    for start, cands in zip(row["action_starts"], row["action_candidates"]):
        n = next(b - a for a, b in mask_runs(mask) if a == start)
        reply = ids[start:start + n]
        per = []
        for c in cands:
            x = torch.tensor([ids[:start] + c])
            logp = torch.log_softmax(model(input_ids=x).logits.float() / T, -1)[0]
            per.append(logp[start - 1:start - 1 + len(c)].gather(-1, torch.tensor(c)[:, None]).squeeze(-1))
        k = next(i for i, c in enumerate(cands) if c == reply)
        tokens = renormalised_logprobs(cands, per, k)
        action = per[k].sum() + math.log(sum(c == reply for c in cands)) - torch.logsumexp(
            torch.stack([p.sum() for p in per]), 0)
        out.append((start, n, tokens, action))
    return out


def test_trainer_logprobs_and_gradient_match_brute_force(model):
    rows = _rows(model.config.vocab_size)
    batch = TrainBatch.from_rows(rows, pad_id=0)
    assert batch.choices is not None and len(batch.choices[0]) == 3
    weights = torch.tensor([0.7, -1.3, 0.4, 2.0, -0.6])  # one per turn: a loss over all of them

    model.zero_grad()
    lp, _, _, _ = policy_forward(model, batch, T, False)
    turns = [(r, s, n) for r, row in enumerate(rows) for s, n, _, _ in _brute(model, row)]
    got = torch.stack([lp[r, s:s + n].sum() for r, s, n in turns])
    (got * weights).sum().backward()
    grad = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    brute = [b for row in rows for b in _brute(model, row)]
    want = torch.stack([a for *_, a in brute])
    (want * weights).sum().backward()
    torch.testing.assert_close(got.detach(), want.detach(), atol=1e-5, rtol=0)
    for (r, s, n), (_, _, tokens, _) in zip(turns, brute):  # token by token too
        torch.testing.assert_close(lp[r, s:s + n].detach(), tokens.detach(), atol=1e-5, rtol=0)
    for k, p in model.named_parameters():
        if p.grad is None:
            continue
        torch.testing.assert_close(grad[k], p.grad, atol=1e-5, rtol=1e-4, msg=k)
    assert any(float(g.abs().max()) > 1e-2 for g in grad.values())
    # every turn's value is far from 0 but the one-candidate turn's (index 2)
    assert float(want.detach().abs()[[0, 1, 3, 4]].min()) > 0.5
    # the single-candidate turn has probability 1 under the renormalised policy
    r0 = rows[0]
    s, n = r0["action_starts"][2], len(r0["action_candidates"][2][0])
    assert lp[0, s:s + n].tolist() == [0.0] * n
    # elsewhere the log-probs are the policy's own, as without choices
    plain, _, _, _ = policy_forward(model, TrainBatch.from_rows([{k: v for k, v in r.items() if not
                                                                  k.startswith("action_")} for r in rows], 0), T, False)
    touched = torch.zeros_like(lp, dtype=torch.bool)
    for r, s, n in turns:
        touched[r, s:s + n] = True
    torch.testing.assert_close(lp.detach()[~touched], plain.detach()[~touched], atol=1e-5, rtol=0)


def test_padding_and_masked_tokens_do_not_change_it(model):
    rows = _rows(model.config.vocab_size, seed=1)
    with torch.no_grad():
        both = policy_forward(model, TrainBatch.from_rows(rows, 0), T, False)[0]
        short = min(range(2), key=lambda r: len(rows[r]["input_ids"]))
        width = len(rows[short]["input_ids"])
        assert width < both.shape[1]  # the longer row pads the shorter one
        torch.testing.assert_close(both[short, :width], policy_forward(
            model, TrainBatch.from_rows([rows[short]], 0), T, False)[0][0], atol=1e-5, rtol=0)
        assert both[short, width:].abs().max() == 0
        assert (both[TrainBatch.from_rows(rows, 0).loss_mask == 0] == 0).all()
        alone = policy_forward(model, TrainBatch.from_rows(rows[:1], 0), T, False)[0]
        # an observation (masked) after the first turn changes that turn's log-probs not at all
        changed = dict(rows[0], input_ids=list(rows[0]["input_ids"]))
        s1 = changed["action_starts"][1]
        changed["input_ids"][s1 - 2] = 7 if changed["input_ids"][s1 - 2] != 7 else 8
        other = policy_forward(model, TrainBatch.from_rows([changed], 0), T, False)[0]
        s0 = changed["action_starts"][0]
        torch.testing.assert_close(other[0, :s1 - 2], alone[0, :s1 - 2], atol=1e-6, rtol=0)
        assert (other[0, s1:] - alone[0, s1:]).abs().max() > 1e-3  # later turns do see it
        assert s0 < s1 - 2


def test_a_reply_that_is_none_of_its_candidates_is_refused(model):
    row = _rows(model.config.vocab_size)[0]
    row["action_candidates"][0] = [[99, 98, 3]]
    with pytest.raises(ValueError, match="none of its"):
        policy_forward(model, TrainBatch.from_rows([row], 0), T, False)
    ep = Episode("e", "g", "babyai", 0, 0, 3, input_ids=row["input_ids"], loss_mask=row["loss_mask"],
                 old_logprobs=[0.0] * len(row["input_ids"]), action_starts=row["action_starts"],
                 action_candidates=row["action_candidates"])
    with pytest.raises(ValueError, match="none of its"):
        ep.validate()


# -- the config ----------------------------------------------------------------------------------
def test_renormalised_needs_constrained_actions():
    assert PipelineConfig().rollout.action_logprob == "policy"
    cfg = PipelineConfig(rollout={"constrain_actions": True, "action_logprob": "renormalised"})
    assert cfg.rollout.action_logprob == "renormalised"
    with pytest.raises(ValueError, match="set rollout.constrain_actions: true, or rollout.action_logprob: policy"):
        PipelineConfig(rollout={"action_logprob": "renormalised"})
    with pytest.raises(ValueError, match="action_logprob"):
        PipelineConfig(rollout={"constrain_actions": True, "action_logprob": "renormalized"})


def test_a_choice_temperature_needs_the_renormalised_rule():
    cfg = PipelineConfig(rollout={"constrain_actions": True, "action_logprob": "renormalised", "action_temperature": 2})
    assert cfg.rollout.action_temperature == 2.0
    with pytest.raises(ValueError, match="or rollout.action_temperature: 1.0"):
        PipelineConfig(rollout={"constrain_actions": True, "action_temperature": 2})
    with pytest.raises(ValueError, match="action_temperature"):
        PipelineConfig(rollout={"constrain_actions": True, "action_logprob": "renormalised", "action_temperature": 0})


# -- the sampler's stored value is the trainer's recomputation -------------------------------------
SYSTEM = "Reach the goal."


@pytest.fixture(scope="module")
def played(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32), tok)
    fmt = ChatFormatter(tok, response_prefix="Action:")

    def play(rule: str, policy: str = "truncate", action_temperature: float = 1.0):
        specs = [EpisodeSpec("babyai", t, 0, f"g{t}", f"e{t}", {"observation_style": "compact"}) for t in range(4)]
        settings = RolloutSettings(horizon=5, max_new_tokens=12, seed=3, system_prompt=SYSTEM, stop=["\n"],
                                   constrain_actions=True, action_logprob=rule, context_policy=policy,
                                   context_window=1, action_temperature=action_temperature)
        return run_episodes(engine, fmt, specs, settings, make_env)

    return play, tiny_path, tok


def test_the_default_rule_records_nothing_and_stores_the_policys_logprobs(played):
    play, _, _ = played
    plain, renorm = play("policy"), play("renormalised")
    assert all(e.action_starts is None and e.action_candidates is None for e in plain)
    # the same draws (the rule changes only what is stored), other log-probs at the choices
    assert [e.input_ids for e in plain] == [e.input_ids for e in renorm]
    assert any(a != b for e, f in zip(plain, renorm) for a, b in zip(e.old_logprobs, f.old_logprobs))
    for e, f in zip(plain, renorm):
        assert f.action_starts == [a for a, _ in mask_runs(f.loss_mask)]  # every reply was constrained
        for s, cands in zip(f.action_starts, f.action_candidates):
            n = next(b - a for a, b in mask_runs(f.loss_mask) if a == s)
            # renormalising raises the reply's log-prob (Z < 1), spread over its tokens
            assert sum(f.old_logprobs[s:s + n]) >= sum(e.old_logprobs[s:s + n]) - 1e-6
            assert all(x <= 1e-6 for x in f.old_logprobs[s:s + n])
            assert f.input_ids[s:s + n] in cands


@pytest.mark.parametrize(("policy", "action_temperature"), [("truncate", 1.0), ("window", 1.0), ("truncate", 2.0)])
def test_the_trainer_recomputes_the_samplers_renormalised_logprobs(played, tmp_path, policy, action_temperature):
    """Through the store (episodes -> EpisodeBatch -> train_batch -> segments -> TrainBatch) the
    trainer's log-probs at the same weights equal the stored ones, and the first PPO step's ratio
    is 1 (within 2e-4, as the other sampler/trainer invariants); at a choice temperature too, which
    the trainer must be given (at 1 its log-probs differ)."""
    from agentgym.store.trajectory_store import TrajectoryStore

    play, path, tok = played
    eps = play("renormalised", policy, action_temperature)
    if policy == "window":
        assert any(e.context_starts for e in eps)
    store = TrajectoryStore(str(tmp_path / "store"), "renorm")
    import datetime as dt

    episodes, turns = store.episode_tables(eps, 0, 0, 0, 0, dt.datetime.now(dt.timezone.utc))
    back = {r["episode_id"]: r for r in episodes.to_pylist()}
    assert [back[e.episode_id]["action_candidates"] for e in eps] == [e.action_candidates for e in eps]
    batch = EpisodeBatch.from_episodes(eps)
    adv = [[0.5 * m for m in e.loss_mask] for e in eps]
    store.write_train_batch(batch.with_columns(advantages=adv), stage=0, iteration=0)
    read = store.read_train_batch(0, 0)
    assert read["action_starts"] == [e.action_starts for e in eps]
    segments, spans = read.segments()
    tb = segments.padded(0)
    assert tb.choices is not None and sum(map(len, tb.choices)) == sum(len(e.action_starts) for e in eps)
    tr = PolicyTrainer(path, tok, TrainerConfig(learning_rate=1e-4, bf16=False, micro_batch_size=2),
                       AlgorithmConfig(), seed=0, temperature=1.0, action_temperature=action_temperature)
    got = merge_segments(tr.compute(tb, ["logprobs"])["logprobs"], spans, (len(eps), max(len(e.input_ids) for e in eps)))
    want = batch.padded(0)
    mask = want.loss_mask.bool()
    torch.testing.assert_close(got[mask], want.old_logprobs[mask], atol=2e-4, rtol=0)
    if action_temperature != 1.0:
        tr.action_temperature = 1.0
        untempered = merge_segments(tr.compute(tb, ["logprobs"])["logprobs"], spans, got.shape)
        assert (untempered[mask] - want.old_logprobs[mask]).abs().max() > 1e-2
        tr.action_temperature = action_temperature
    # the policy's own log-probs are not what was stored
    plain = tr.compute(TrainBatch(**{**tb.tensors()}), ["logprobs"])["logprobs"]
    assert (merge_segments(plain, spans, got.shape)[mask] - want.old_logprobs[mask]).abs().max() > 1e-2
    m = tr.train_on_batch(tb)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=2e-4) and m["clipfrac"] == 0.0
    assert m["approx_kl"] == pytest.approx(0.0, abs=2e-4)


def test_an_old_store_reads_null_candidates(tmp_path):
    """Files written before the columns existed read as null: the default rule."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from agentgym.store.schema import physical_schema, read_parquet

    schema = physical_schema("train_batch")
    old = pa.schema([f for f in schema if not f.name.startswith("action_")])
    t = pa.Table.from_pylist([{"run_id": "r", "episode_id": "e", "input_ids": [1, 2], "loss_mask": [0, 1],
                               "old_logprobs": [0.0, -1.0], "advantages": [0.0, 1.0], "returns": [],
                               "old_values": [], "context_starts": []}], schema=old)
    buf = pa.BufferOutputStream()
    pq.write_table(t, buf)
    got = read_parquet(buf.getvalue().to_pybytes(), schema.names, "train_batch")
    assert got.column("action_starts").to_pylist() == [None]
    assert got.column("action_candidates").to_pylist() == [None]


def test_the_pipeline_trains_on_the_renormalised_ratio(tmp_path, model_cache):
    """PolicySession end to end (rollout -> episodes table -> advantages -> train_batch table ->
    trainer): the recomputed old log-probs are the sampler's renormalised ones, and the one
    optimizer step is on-policy (ratio 1)."""
    from agentgym.pipeline import IterationRef, PolicySession
    from configs import DEFAULT, parse_tiny_config

    cfg = parse_tiny_config(
        model_cache, store_root=tmp_path / "store", system_prompt=SYSTEM, seed=1,
        envs=[{"name": "babyai", "tasks": [0, 1, 2, 3], "kwargs": {"observation_style": "compact"}}],
        rollout={"max_new_tokens": 12, "response_prefix": "Action:", "stop": ["\n"], "constrain_actions": True,
                 "action_logprob": "renormalised", "tasks_per_iteration": 2, "group_size": 4},
        algorithm={"recompute_old_logprobs": True, "skip_tied_groups": False},
        trainer={"learning_rate": DEFAULT}, schedule={"stages": [{"horizon": 3, "iterations": 1}]})
    session = PolicySession(cfg, "renorm")
    try:
        ref = IterationRef(0, 0, 0)
        session.collect(ref, 3)
        episodes = session.store.read_episodes(0, 0, turn_text=False)
        assert all(e.action_starts and len(e.action_starts) == e.num_turns for e in episodes)
        session.advantages(ref)
        m = session.update(ref)
        assert m["updated"]
        assert m["old_logprob_abs_diff"] < 2e-4 and m["ratio_mean"] == pytest.approx(1.0, abs=2e-4)
        trained = session.store.read_train_batch(0, 0)
        by_id = {e.episode_id: e for e in episodes}
        assert [by_id[i].action_candidates for i in trained["episode_id"]] == trained["action_candidates"]
    finally:
        session.close()
