"""Agentic episodes on the tiny model: the KV cache across turns, seeds, and the masked loss."""

import copy
from pathlib import Path

import pytest
import torch

from tests.agentic_replay import ReplayPolicy
from tunelab.data import apply_chat_template, load_tokenizer
from tunelab.rl import (
    GRPOLoss,
    Rollout,
    SamplingSettings,
    completion_logps,
    exact_total,
    policy_gradient_pass,
)
from tunelab.rl.agentic import (
    CachedTurnSampler,
    EpisodeLimits,
    EpisodeRunner,
    Toolbox,
    calculator,
    episode_batch,
)
from tunelab.rl.agentic.tools import tool_from_function
from tunelab.training import load_model

TINY = Path(__file__).resolve().parents[2] / "framework" / "tunelab" / "assets" / "tiny"
SCHEMA = tool_from_function(calculator, "test").schema


@pytest.fixture(scope="module")
def tiny():
    tokenizer = load_tokenizer(
        str(TINY), max_seq_len=512, chat_template=str(TINY / "tools_chat_template.jinja")
    )
    model = load_model(str(TINY), device=torch.device("cpu"), mesh=None, dtype=torch.float32)
    return tokenizer, model


def uncached_turns(model, turns, max_new):
    """Greedy replies, each token from a full forward over the whole sequence (no cache)."""
    sequence, replies = [], []
    for new_tokens, limit in zip(turns, max_new, strict=True):
        sequence += new_tokens
        reply = []
        for _ in range(limit):
            with torch.no_grad():
                logits = model(torch.tensor([sequence]))[0, -1]
            reply.append(int(logits.argmax()))
            sequence.append(reply[-1])
        replies.append(reply)
    return replies


def test_cached_turns_equal_full_forwards(tiny):
    tokenizer, model = tiny
    settings = SamplingSettings(max_new_tokens=8, temperature=0.0)
    sampler = CachedTurnSampler(model, settings, pad_id=tokenizer.pad_id)
    g = torch.Generator().manual_seed(0)
    vocab = model.args.vocab_size

    def tokens(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    # Three episodes, ragged: prompts and deltas of different lengths; row 2 ends after turn 1.
    plan = [
        [tokens(7), tokens(3), tokens(5)],
        [tokens(12), tokens(9), tokens(1)],
        [tokens(4), None, None],
    ]
    limits = [[5, 3, 4], [2, 6, 4], [6, 0, 0]]
    got = [[] for _ in plan]
    with sampler.session(rows=3, capacity=64):
        for turn in range(3):
            new = [row[turn] for row in plan]
            replies = sampler.turn(new, [torch.Generator()] * 3, [row[turn] for row in limits])
            for row, reply in enumerate(replies):
                if new[row] is not None:
                    got[row].append(reply)
    # The cache prefilled only what was new: prompts, deltas and the previous reply's last token.
    fed = sum(len(t) for row in plan for t in row if t is not None) + 2 * 2
    assert sampler.prefill_tokens == fed
    assert not model.caches_are_enabled()
    for row, replies in enumerate(got):
        turns = [t for t in plan[row] if t is not None]
        # Each new turn is fed after the previous reply's tokens: the reference sees them too.
        assert replies == uncached_turns(model, turns, [n for n in limits[row] if n]), row


def test_sampled_episodes_depend_on_their_seed_only(tiny):
    tokenizer, model = tiny
    settings = SamplingSettings(max_new_tokens=24, stop_ids=frozenset(tokenizer.stop_ids))
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=96)

    def run(prompts, seeds):
        sampler = CachedTurnSampler(model, settings, pad_id=tokenizer.pad_id)
        runner = EpisodeRunner(sampler, tokenizer, tokenizer.chat_template,
                               Toolbox([calculator]), limits)  # fmt: skip
        return runner.run(prompts, seeds)

    prompts = [([{"role": "user", "content": text}], {}) for text in ("Add 3 and 4.", "7 * 6?")]
    together = run(prompts * 2, [1, 2, 3, 4])
    alone = run(prompts[1:], [2])
    assert together[1].tokens == alone[0].tokens and together[1].messages == alone[0].messages
    # Other seeds, other episodes: the tiny model's likeliest answer is short, so two seeds may
    # sample the same one; four seeds of one prompt do not all agree.
    assert len({tuple(e.tokens) for e in run([prompts[0]] * 4, [1, 3, 5, 7])}) > 1
    for episode in together:
        assert len(episode.tokens) <= limits.max_episode_tokens
        assert episode.trained[0] and len(episode.trained) == len(episode.tokens)
        # The recorded behaviour log-probs, one per id (0.0 on template and tool ids).
        assert len(episode.logps) == len(episode.tokens)
        assert all(v < 0 for v, t in zip(episode.logps, episode.trained, strict=True) if t)
        assert all(v == 0 for v, t in zip(episode.logps, episode.trained, strict=True) if not t)


def multi_turn_episodes(tokenizer, parameters=list):
    """Three episodes with tool calls, results and answers (the policy replayed; its model's
    ``parameters()`` are ``parameters()``: none by default)."""

    def call(n, expression):
        arguments = {"expression": expression}
        return {"id": f"c{n}", "type": "function", "function": {"name": "calculator",
                "arguments": arguments}}  # fmt: skip

    def tool(n, content):
        return {"role": "tool", "tool_call_id": f"c{n}", "name": "calculator", "content": content}

    user = {"role": "user", "content": "Add the numbers."}
    conversations = [
        [user, {"role": "assistant", "content": "", "tool_calls": [call(0, "3 + 4")]},
         tool(0, "7"), {"role": "assistant", "content": "7"}],
        [user, {"role": "assistant", "content": "", "reasoning_content": "Two.",
                "tool_calls": [call(0, "1 + 1"), call(1, "2 * 8")]},
         tool(0, "2"), tool(1, "16"), {"role": "assistant", "content": "2 and 16"}],
        [user, {"role": "assistant", "content": "No tools needed: 5"}],
    ]  # fmt: skip
    references = [apply_chat_template(tokenizer, c, tools=[SCHEMA]) for c in conversations]
    policy = ReplayPolicy(references, tokenizer.stop_ids)
    policy.model.parameters = parameters
    runner = EpisodeRunner(policy, tokenizer, tokenizer.chat_template, Toolbox([calculator]),
                           EpisodeLimits(max_episode_tokens=400))  # fmt: skip
    episodes = runner.run([(c[:1], {}) for c in conversations], [0, 1, 2])
    return episodes, policy


def test_multi_turn_loss_equals_fp64_reference_with_tool_tokens_masked(tiny):
    tokenizer, model = tiny
    episodes, policy = multi_turn_episodes(tokenizer)
    assert [e.num_tool_calls for e in episodes] == [1, 2, 0]
    batch = episode_batch(episodes, tokenizer.pad_id, torch.device("cpu"))
    labels = batch["labels"]
    for row, episode in enumerate(episodes):  # labelled: exactly the replayed replies
        start = len(episode.prompt_tokens)
        labelled = labels[row][labels[row] != -100].tolist()
        assert labelled == [t for reply in policy.replies[row] for t in reply]
        assert (labels[row, :start] == -100).all()
    model = copy.deepcopy(model)
    logps, mask = completion_logps(model, batch)
    old = (
        logps.detach() + 0.3 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(0))
    ) * mask
    advantages = torch.tensor([0.8, -1.2, 0.4])
    loss_fn = GRPOLoss(clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token_mean")
    rollout = Rollout(batch, advantages, torch.ones(3, dtype=torch.bool), old_logps=old)
    sums = policy_gradient_pass(model, [rollout], loss_fn, None, scale=1.0)

    # fp64 reference, written out: log-softmax of the next token at every trained position.
    reference_model = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = reference_model(batch["tokens"]).double()
    all_logps = torch.log_softmax(logits[:, :-1], dim=-1)
    targets = batch["tokens"][:, 1:]
    token_logps = all_logps.gather(-1, targets[..., None])[..., 0]

    def reference_loss(positions):
        ratio = torch.exp(token_logps - old.double())
        a = advantages.double()[:, None]
        surrogate = torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
        return float((-surrogate * positions).sum())

    trained = (labels[:, 1:] != -100).double()
    assert sums["loss"] == pytest.approx(reference_loss(trained), rel=1e-6, abs=1e-6)
    # The tool and template tokens carry weight if they are not masked: the test can fail.
    real = (batch["tokens"][:, 1:] != tokenizer.pad_id).double()
    assert abs(reference_loss(real) - sums["loss"]) > 1e-2


def test_the_episode_loop_agrees_over_ranks_only_where_forwards_communicate(
    tiny, monkeypatch, tmp_path
):
    """Each turn, "does any rank go on?" is an all-reduce over the default group only where a
    forward runs collectives (a DTensor parameter: FSDP2 shards not held gathered); a whole
    model's loop (the sampling thread of rollout.overlap, a rollout rank) runs none, so it may
    run beside the training's collectives. Here one more rank, by the all-reduce, goes on for
    3 turns; this rank's episodes end after 2 (the third at its first)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    tokenizer, _ = tiny
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = [DTensor.from_local(torch.zeros(4), mesh, [Replicate()])]
        flags = []

        def all_reduce(flag, *args, **kwargs):
            flags.append(float(flag))
            flag += 1.0 if len(flags) <= 3 else 0.0  # the other rank: 3 turns

        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "all_reduce", all_reduce)
        # A whole model: this rank's own turns, no collective.
        episodes, policy = multi_turn_episodes(tokenizer)
        assert [e.num_turns for e in episodes] == [2, 2, 1]
        assert (policy.turns, flags) == (2, [])
        whole = [[m["content"] for m in e.messages] for e in episodes]
        # A DTensor parameter: one all-reduce per turn, and the turns of the slowest rank (a
        # third with every episode of this rank ended, whose forward the other rank needs).
        episodes, policy = multi_turn_episodes(tokenizer, parameters=lambda: iter(sharded))
        assert (policy.turns, flags) == (3, [1.0, 1.0, 0.0, 0.0])
        assert [[m["content"] for m in e.messages] for e in episodes] == whole
    finally:
        dist.destroy_process_group()


def test_episode_groups_score_the_whole_episode_with_the_environments_reward(tiny):
    from types import SimpleNamespace

    from tunelab.rl import Rewards, sampling_seeds
    from tunelab.rl.agentic import EpisodeGroupSampler, KeyValueStore

    tokenizer, _ = tiny
    box = Toolbox([], {"KeyValueStore": KeyValueStore})
    row = {"prompt": "Use the store.", "answer": "done"}
    seeds = sampling_seeds(7, 0, [0], 2)

    def reference(seed, solve):
        env = box.start(row, seed).environment
        first, second = env.wanted
        ask = {"role": "user", "content": f"Use the store.\n\n{env.reset(row, seed)}"}

        def call(n, name, **arguments):
            return {"id": f"c{n}", "type": "function",
                    "function": {"name": name, "arguments": arguments}}  # fmt: skip

        total = env.store[first] + env.store[second] + (0 if solve else 1)
        conversation = [
            ask,
            {"role": "assistant", "content": "", "tool_calls": [
                call(0, "get", key=first), call(1, "get", key=second)]},
            {"role": "tool", "tool_call_id": "c0", "name": "get", "content": str(env.store[first])},
            {"role": "tool", "tool_call_id": "c1", "name": "get", "content": str(env.store[second])},
            {"role": "assistant", "content": "", "tool_calls": [call(2, "set", key="total", value=total)]},
            {"role": "tool", "tool_call_id": "c2", "name": "set", "content": "ok"},
            {"role": "assistant", "content": "done"},
        ]  # fmt: skip
        schemas = box.start(row, seed).schemas
        return apply_chat_template(tokenizer, conversation, tools=schemas)

    policy = ReplayPolicy(
        [reference(seeds[0], True), reference(seeds[1], False)], tokenizer.stop_ids
    )
    runner = EpisodeRunner(
        policy, tokenizer, tokenizer.chat_template, box, EpisodeLimits(max_episode_tokens=600)
    )
    rewards = Rewards([{"_component_": "tunelab.rl.exact_answer_reward", "column": "answer"}])
    prompts = SimpleNamespace(rows=[row], prompts=["Use the store."])
    sampler = EpisodeGroupSampler(
        runner, rewards, prompts, prompt_column="prompt", environment_weight=2.0,
        decode=tokenizer.decode, pad_id=tokenizer.pad_id, num_generations=2, seed=7,
        scale_rewards=True, dynamic_sampling=False, device=torch.device("cpu"),
    )  # fmt: skip
    scored = sampler.sample([0], step=0)
    # exact_answer 1 each; the environment's 1.0 (solved) or 0.5 (both keys read), weight 2.
    assert [r["reward"] for r in scored.records] == [3.0, 2.0]
    assert exact_total(scored.sums, "rewards/environment") == 1.5
    assert scored.sums["agentic/tool_calls"] == 6 and scored.sums["agentic/turns"] == 6
    assert scored.sums["agentic/stop/answer"] == 2
    assert scored.rollout.advantages[0] > 0 > scored.rollout.advantages[1]
    assert scored.rollout.behaviour_logps is None  # a replayed policy records no log-probs
    record = scored.records[0]
    assert [m["role"] for m in record["messages"]] == [
        "user", "assistant", "tool", "tool", "assistant", "tool", "assistant"]  # fmt: skip
    assert record["environment"] == "KeyValueStore"
    assert (scored.rollout.batch["labels"] != -100).sum() == sum(
        sum(r["trained"]) for r in scored.records
    )


def test_a_kv_cache_beyond_memory_is_one_line_before_any_allocation(tiny, monkeypatch):
    from tunelab.errors import ConfigError
    from tunelab.rl.agentic import turn_sampler

    tokenizer, model = tiny
    sampler = CachedTurnSampler(model, SamplingSettings(max_new_tokens=4), pad_id=0)
    monkeypatch.setattr(turn_sampler, "memory_budget_bytes", lambda device: 2**20)
    with pytest.raises(ConfigError, match=r"agentic episodes need .* GiB for the KV cache \(64 "):
        with sampler.session(rows=64, capacity=512):
            pass
    assert not model.caches_are_enabled()
    with sampler.session(rows=1, capacity=8):  # 1 x 9 x 3 x 2 x 2 x 32 x 4 bytes fits 1 MiB
        assert model.caches_are_enabled()


def test_a_long_tool_error_is_cut_to_its_token_budget_and_the_episode_goes_on(tiny):
    from tunelab.rl.agentic import call_tool
    from tunelab.rl.agentic.episodes import CUT_MARKER, cut_tool_result
    from tunelab.rl.agentic.tools import ToolCall

    tokenizer, _ = tiny
    box = Toolbox([calculator])
    error = call_tool(box.shared, ToolCall("calculator", {"expression": "a + 1"}, "c0")).content
    limits = EpisodeLimits(max_episode_tokens=120, max_tool_result_tokens=24)
    assert len(tokenizer.encode(error, add_bos=False)) > 80  # the tiny calculator's error
    cut, was_cut = cut_tool_result(error, limits, tokenizer)
    assert was_cut and cut.endswith(CUT_MARKER) and error.startswith(cut[: -len(CUT_MARKER)])
    assert 18 <= len(tokenizer.encode(cut, add_bos=False)) <= 24
    assert cut_tool_result("7", limits, tokenizer) == ("7", False)
    chars = EpisodeLimits(max_tool_result_chars=20)
    assert cut_tool_result("x" * 50, chars, tokenizer) == ("x" * 14 + CUT_MARKER, True)

    # The policy calls with a bad expression, reads the cut error and answers: within 120
    # tokens, which the whole error (86 tokens) would not have left room for.
    call = {"id": "c0", "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "a + 1"}}}  # fmt: skip
    conversation = [
        {"role": "user", "content": "Add."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0", "name": "calculator", "content": cut},
        {"role": "assistant", "content": "2"},
    ]
    reference = apply_chat_template(tokenizer, conversation, tools=[SCHEMA])
    policy = ReplayPolicy([reference], tokenizer.stop_ids)
    runner = EpisodeRunner(policy, tokenizer, tokenizer.chat_template, box, limits)
    (episode,) = runner.run([(conversation[:1], {})], [0])
    assert episode.stop_reason == "answer" and episode.tool_results_cut == 1
    ids = episode.prompt_tokens + episode.tokens  # through the answer's end-of-turn token
    assert ids == reference[: len(ids)] and len(reference) - len(ids) == 1  # its newline
    assert len(episode.tokens) <= 120
    assert episode.messages[2]["content"] == cut and episode.tool_errors == {"exception": 1}
    whole = EpisodeLimits(max_episode_tokens=120, max_tool_result_tokens=256)
    runner = EpisodeRunner(ReplayPolicy([reference], tokenizer.stop_ids), tokenizer,
                           tokenizer.chat_template, box, whole)  # fmt: skip
    (uncut,) = runner.run([(conversation[:1], {})], [0])
    assert uncut.stop_reason == "max_episode_tokens" and len(uncut.tokens) < len(episode.tokens)


def test_recorded_behaviour_logps_equal_a_fresh_forward_with_tool_tokens_masked(tiny):
    """Each sampled token's recorded log-prob is the training forward's (fp32, as the single-turn
    engine's: tests/unit/test_grpo_async.py); the tokens fed between turns (a tool result's
    delta) carry none and are masked out of the loss and the off-policy correction."""
    from tunelab.rl import behaviour_logps_batch
    from tunelab.rl.agentic import Episode
    from tunelab.training import output_layer

    tokenizer, model = tiny
    sampler = CachedTurnSampler(model, SamplingSettings(max_new_tokens=6), pad_id=tokenizer.pad_id)
    g = torch.Generator().manual_seed(3)

    def tokens(n):
        return torch.randint(3, model.args.vocab_size, (n,), generator=g).tolist()

    # Three episodes, ragged: row 2 ends after its first reply; rows 0 and 1 get a delta.
    plan = [[tokens(7), tokens(3)], [tokens(12), tokens(9)], [tokens(4), None]]
    limits = [[5, 4], [2, 6], [6, 0]]
    episodes = [Episode(row[0]) for row in plan]
    generators = [torch.Generator().manual_seed(seed) for seed in range(3)]
    with sampler.session(rows=3, capacity=64):
        for turn in range(2):
            new = [row[turn] for row in plan]
            replies = sampler.turn(new, generators, [row[turn] for row in limits])
            assert [len(v) for v in sampler.last_logps] == [len(r) for r in replies]
            for row, (episode, reply) in enumerate(zip(episodes, replies, strict=True)):
                if new[row] is None:
                    continue
                if turn:  # the delta fed before this reply: not sampled, never trained
                    episode.tokens += new[row]
                    episode.trained += [False] * len(new[row])
                    episode.logps += [0.0] * len(new[row])
                episode.tokens += reply
                episode.trained += [True] * len(reply)
                episode.logps += sampler.last_logps[row]
    batch = episode_batch(episodes, tokenizer.pad_id, torch.device("cpu"))
    width = batch["tokens"].shape[1]
    recorded = behaviour_logps_batch(
        [e.prompt_tokens for e in episodes], [e.logps for e in episodes], width, "cpu"
    )
    with torch.no_grad():
        logps, mask = completion_logps(model, batch, output_layer(model))
    assert mask.sum() == sum(sum(e.trained) for e in episodes) == 5 + 4 + 2 + 6 + 6
    for row, episode in enumerate(episodes):  # the deltas' positions are masked
        start = len(episode.prompt_tokens) - 1
        trained = torch.tensor(episode.trained)
        assert mask[row, start : start + len(trained)].tolist() == trained.tolist()
    assert (recorded[~mask] == 0).all()
    # The KV cache across turns rounds differently from the training forward (fp32).
    torch.testing.assert_close(recorded[mask], logps[mask], atol=2e-5, rtol=0)
    assert (logps[mask] < -1e-3).any()  # not a trivially certain model
