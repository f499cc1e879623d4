"""critic.py: the weighted-IQL equations against hand-worked cases, the head positions, and a real run."""
import json
import math

import pytest
import torch

import common
import models
import critic
from conftest import run_script, tensorboard_scalars
from tools import critic_eval


def test_iql_weights_by_hand():
    # paper eq. 4 worked by hand: T = 4, t = 3 gives 0.5·(3/4 + 1) + 0.5 = 1.375 and 0.5·(3/4) + 0.5 = 0.875
    torch.testing.assert_close(critic.iql_weights(4, True), torch.tensor([1.125, 1.25, 1.375, 1.5]))
    torch.testing.assert_close(critic.iql_weights(4, False), torch.tensor([0.625, 0.75, 0.875, 1.0]))
    torch.testing.assert_close(critic.iql_weights(2, True, temporal=False), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(critic.iql_weights(2, True, success_term=False), torch.tensor([0.75, 1.0]))


def test_expectile_loss_by_hand():
    got = critic.expectile_loss(torch.tensor([2.0, -2.0, 0.0, -0.5]), 0.7)
    torch.testing.assert_close(got, torch.tensor([2.8, 1.2, 0.0, 0.075]))
    # m = 0.5 is half the squared error
    torch.testing.assert_close(critic.expectile_loss(torch.tensor([3.0, -3.0]), 0.5), torch.tensor([4.5, 4.5]))


def test_gae_by_hand_and_as_returns():
    adv = critic.gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.6, 0.8, 0.0]), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([0.23008, 0.264, 0.2]))
    # λ = 1: the discounted return minus V_t
    r, v = torch.tensor([0.1, -0.2, 0.0, 1.0]), torch.tensor([0.3, 0.1, 0.4, 0.2, 0.0])
    returns = torch.tensor([sum(0.9 ** (k - t) * r[k] for k in range(t, 4)) for t in range(4)])
    torch.testing.assert_close(critic.gae(r, v, 0.9, 1.0), returns - v[:4])
    # λ = 0: the one-step TD error
    torch.testing.assert_close(critic.gae(r, v, 0.9, 0.0), r + 0.9 * v[1:] - v[:4])


def test_iql_targets_by_hand():
    traj = {"reward": 1.0, "success": True,
            "steps": [{"env_reward": 0.0, "aux_reward": -0.2}, {"env_reward": 1.0, "aux_reward": 0.0}]}
    args = critic.Args(data="", policy="", expectile=0.7, gamma=0.5)
    V, Q, Qt = torch.tensor([0.4, 0.6]), torch.tensor([0.1, 0.9]), torch.tensor([1.0, 0.2])
    loss, parts = critic.iql_loss(traj, V, Q, Qt, args)
    w = [0.5 * (0.5 + 1) + 0.5, 1.5]                      # 1.25, 1.5
    q_targets = [-0.2 + 0.5 * 0.6, 1.0 + 0.0]           # r + γ V_{t+1}, V after the last step = 0
    loss_q = w[0] * (q_targets[0] - 0.1) ** 2 + w[1] * (q_targets[1] - 0.9) ** 2
    loss_v = w[0] * 0.7 * (1.0 - 0.4) ** 2 + w[1] * 0.3 * (0.2 - 0.6) ** 2
    assert parts["loss_q"] == pytest.approx(loss_q) and parts["loss_v"] == pytest.approx(loss_v)
    assert loss.item() == pytest.approx(loss_q + loss_v)


def test_a_cut_episode_bootstraps_from_its_last_state_by_hand():
    # Two steps, no reward, cut by the step cap: the chat holds the state after the last step, so V has three
    # entries. γ = 0.5, λ = 0.95, failure: w = 0.5 · (t/2) + 0.5 = 0.75, 1.0.
    step = {"env_reward": 0.0, "aux_reward": 0.0}
    cut = {"reward": 0.0, "success": False, "truncated": True, "steps": [step, step]}
    V, Q, Qt = torch.tensor([0.4, 0.6, 0.5]), torch.tensor([0.1, 0.2]), torch.tensor([0.3, 0.3])
    args = critic.Args(data="", policy="", gamma=0.5, gae_lambda=0.95)
    _, parts = critic.iql_loss(cut, V, Q, Qt, args)
    # Q targets r + γ V_{t+1}: 0.5 · 0.6 = 0.3 and 0.5 · V(s_2) = 0.25; V regresses on the two steps' states only
    assert parts["loss_q"] == pytest.approx(0.75 * (0.3 - 0.1) ** 2 + 1.0 * (0.25 - 0.2) ** 2)
    # expectile weights |0.7 − 1(δ < 0)| = 0.3 for both δ = Q̄ − V (−0.1, −0.3)
    assert parts["loss_v"] == pytest.approx(0.75 * 0.3 * 0.1 ** 2 + 1.0 * 0.3 * 0.3 ** 2)
    # GAE: δ_1 = 0.5·0.5 − 0.6 = −0.35, δ_0 = 0.5·0.6 − 0.4 = −0.1, A_0 = −0.1 + 0.5·0.95·(−0.35)
    torch.testing.assert_close(critic.process_rewards(cut, V, Q, args), torch.tensor([-0.26625, -0.35]))
    # the same episode read as ended (the task over, or --no-bootstrap-truncated): V after it is 0
    for traj, a in (({**cut, "truncated": False}, args), (cut, critic.Args(data="", policy="", gamma=0.5,
                                                                          gae_lambda=0.95, bootstrap_truncated=False))):
        _, parts = critic.iql_loss(traj, V, Q, Qt, a)
        assert parts["loss_q"] == pytest.approx(0.75 * (0.3 - 0.1) ** 2 + 1.0 * (0.0 - 0.2) ** 2)
        torch.testing.assert_close(critic.process_rewards(traj, V, Q, a), torch.tensor([-0.385, -0.6]))
    # a cut chat without room for its final state: the last state it holds stands in (V_1 = 0.6)
    torch.testing.assert_close(critic.process_rewards(cut, V[:2], Q, args), torch.tensor([-0.2425, -0.3]))


def test_success_term_d_from_the_success_flag_or_the_steps_reward():
    # A ScienceWorld-like episode that starts with 0.5 of the score (an open door) and earns 0.25 by its own
    # steps, without finishing the task: its final reward 0.75 is > 0, but it is no success.
    steps = [{"env_reward": 0.25, "aux_reward": 0.0}, {"env_reward": 0.0, "aux_reward": 0.0}]
    partial = {"reward": 0.75, "success": False, "steps": steps}
    idle = {"reward": 0.5, "success": False, "steps": [{**s, "env_reward": 0.0} for s in steps]}
    by_flag, by_reward = (critic.Args(data="", policy="", d_from=d) for d in ("success", "reward"))
    torch.testing.assert_close(critic.step_weights(partial, by_flag), critic.iql_weights(2, False))
    torch.testing.assert_close(critic.step_weights(partial, by_reward), critic.iql_weights(2, True))
    # the score it had before any step is no reward of the episode's: d = 0 both ways
    for a in (by_flag, by_reward):
        torch.testing.assert_close(critic.step_weights(idle, a), critic.iql_weights(2, False))
    won = {**partial, "reward": 1.0, "success": True}
    torch.testing.assert_close(critic.step_weights(won, by_flag), critic.iql_weights(2, True))


def test_fit_heads_bootstraps_a_cut_episode():
    # As above, plus C: s0 -e-> s1, cut there (the chat holds s1). Its action's Q is its own feature, so the
    # exact fit gives Q(s0,e) = 0 + 0.99 · V(s1) = 0.99 when cut episodes bootstrap, 0 when read as ended.
    e = torch.eye(6)
    step = {"env_reward": 0.0, "aux_reward": 0.0}
    a = {"reward": 1.0, "success": True, "steps": [step, {**step, "env_reward": 1.0}]}
    c = {"reward": 0.0, "success": False, "truncated": True, "steps": [step]}
    feats = [(e[[0, 1]], e[[2, 3]]), (e[[0, 1]], e[[5]])]
    for bootstrap, want in ((True, 0.99), (False, 0.0)):
        heads = critic.Heads(6)
        args = critic.Args(data="-", policy="-", refit_ridge=1e-9, refit_rounds=5, bootstrap_truncated=bootstrap)
        critic.fit_heads(heads, feats, [a, c], args)
        with torch.no_grad():
            assert heads.q(e[5]).item() == pytest.approx(want, abs=1e-5)
            assert heads.v(e[1]).item() == pytest.approx(1.0, abs=1e-5)  # V(s1) = Q(s1,b) = 1 either way


def test_clip_values_keeps_a_looping_cut_episode_within_the_data_returns():
    # A loop: three steps in one state s (the same features), each r_aux = −0.2, cut by the step cap, so Q(s, loop)
    # bootstraps from V(s) itself: fitted IQL walks towards −0.2 / (1 − 0.99) = −20, far below any return in the
    # data. The returns: the loop's −0.2 · (1 + 0.99 + 0.99²) = −0.59402 at its start, and a won episode's 1.
    e = torch.eye(4)
    loop = {"reward": 0.0, "success": False, "truncated": True,
            "steps": [{"env_reward": 0.0, "aux_reward": -0.2}] * 3}
    won = {"reward": 1.0, "success": True, "steps": [{"env_reward": 1.0, "aux_reward": 0.0}]}
    low = -0.2 * (1 + 0.99 + 0.99 ** 2)
    assert critic.return_range([loop, won], 0.99) == pytest.approx((low, 1.0))
    feats = [(e[[0, 0, 0, 0]], e[[1, 1, 1]]), (e[[2]], e[[3]])]  # the loop's chat also holds the state after it
    args = critic.Args(data="-", policy="-", refit_ridge=1e-9, refit_rounds=20)
    for bounds in (None, critic.return_range([loop, won], 0.99)):
        heads = critic.Heads(4)
        critic.fit_heads(heads, feats, [loop, won], args, bounds)
        with torch.no_grad():
            v_loop, v_won = heads.v(e[0]).item(), heads.v(e[2]).item()
        assert v_won == pytest.approx(1.0, abs=1e-5)
        if bounds is None:  # 20 rounds: −0.2 · (1 − 0.99^20) / 0.01 = −3.64
            assert v_loop == pytest.approx(-0.2 * (1 - 0.99 ** 20) / 0.01, abs=1e-3)
        else:  # Q's target −0.2 + 0.99 · V(s) is clipped at the lowest return, and V(s) with it
            assert v_loop == pytest.approx(low, abs=1e-5)
    # the gradient loss reads the same clipped values: Q's target −0.2 + 0.99 · clip(−5), V's target clip(Q̄ = 3)
    V, Q, Qt = torch.tensor([-5.0, -5.0, -5.0, -5.0]), torch.zeros(3), torch.full((3,), 3.0)
    _, parts = critic.iql_loss(loop, V, Q, Qt, args, (low, 1.0))
    w = critic.step_weights(loop, args)
    assert parts["loss_q"] == pytest.approx(float(w.sum()) * (-0.2 + 0.99 * low) ** 2)
    assert parts["loss_v"] == pytest.approx(float(w.sum()) * 0.7 * (1.0 + 5.0) ** 2)


@pytest.fixture(scope="module")
def tiny():
    return models.load_base("tiny")


def test_fit_heads_reaches_the_iql_fixed_point_by_hand():
    # One-hot features, so the heads can fit every state exactly and the fixed point of eqs. 1, 2, 4, 5 is the
    # tabular one. Trajectory A (success) s0 -a-> s1 -b-> end with rewards 0, 1; B (failure) s0 -c-> end, 0.
    # Q(s1,b) = 1 and V(s1) = 1 (one action); Q(s0,a) = 0 + 0.99 · 1; Q(s0,c) = 0. V(s0) is the weighted
    # 0.7-expectile of {0.99 with w = 1.25 (A's step 1: 0.5 · (1/2 + 1) + 0.5), 0 with w = 1.0 (B's step 1)}:
    # 0.7 · 1.25 · 0.99 / (0.7 · 1.25 + 0.3 · 1.0) = 0.73723...
    e = torch.eye(5)
    step = {"env_reward": 0.0, "aux_reward": 0.0}
    a = {"reward": 1.0, "success": True, "steps": [step, {**step, "env_reward": 1.0}]}
    b = {"reward": 0.0, "success": False, "steps": [step]}
    feats = [(e[[0, 1]], e[[2, 3]]), (e[[0]], e[[4]])]
    heads = critic.Heads(5)
    args = critic.Args(data="-", policy="-", refit_ridge=1e-9, refit_rounds=5)
    report = critic.fit_heads(heads, feats, [a, b], args)
    with torch.no_grad():
        V, Q = heads.v(e[:2]).squeeze(-1), heads.q(e[2:]).squeeze(-1)
    torch.testing.assert_close(V, torch.tensor([0.7 * 1.25 * 0.99 / (0.7 * 1.25 + 0.3), 1.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(Q, torch.tensor([0.99, 1.0, 0.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(heads.q_target.weight, heads.q.weight)
    assert report["last_round_change"] < 1e-6
    # a ridge penalty pulls every state towards the mean: V(s1) no longer reaches its return
    critic.fit_heads(heads, feats, [a, b], critic.Args(data="-", policy="-", refit_ridge=1.0, refit_rounds=20))
    with torch.no_grad():
        assert heads.v(e[1]).item() < 0.95


def test_heads_read_the_state_and_action_ends(tiny, sciworld_expert):
    model, tok = tiny
    traj = common.read_jsonl(sciworld_expert)[0]
    ids, v_pos, q_pos = critic.encode(tok, traj)
    ids = ids[0].tolist()
    assistant = [k for k, m in enumerate(traj["messages"]) if m["role"] == "assistant"]
    for t, k in enumerate(assistant):
        state = tok.apply_chat_template(traj["messages"][:k], tokenize=False, add_generation_prompt=True)
        action = tok.apply_chat_template(traj["messages"][:k + 1], tokenize=False)
        assert tok.decode(ids[:v_pos[t] + 1]) == state  # V_t sees exactly u, h_t, o_t
        # Q_t sees a_t up to its end-of-turn token (the last token the policy generates), nothing of o_{t+1}
        assert tok.decode(ids[:q_pos[t] + 1]) + "\n" == action
        assert tok.decode(ids[q_pos[t]]) == "<|im_end|>"


def test_one_forward_per_trajectory_equals_one_per_step(tiny, sciworld_expert):
    model, tok = tiny
    heads = critic.Heads(model.config.hidden_size)
    assert all((p == 0).all() for p in heads.parameters())  # V = Q = 0 before training
    torch.manual_seed(0)
    for p in heads.parameters():  # zero heads would make any two read-outs agree
        torch.nn.init.normal_(p)
    traj = common.read_jsonl(sciworld_expert)[0]
    ids, v_pos, q_pos = critic.encode(tok, traj)
    with torch.no_grad():
        V, Q, _ = critic.values(model, heads, ids, v_pos, q_pos)
        for t in range(len(traj["steps"])):
            Vt, _, _ = critic.values(model, heads, ids[:, :v_pos[t] + 1], v_pos[t:t + 1], v_pos[t:t + 1])
            _, Qt, _ = critic.values(model, heads, ids[:, :q_pos[t] + 1], q_pos[t:t + 1], q_pos[t:t + 1])
            assert Vt.item() == pytest.approx(V[t].item(), abs=1e-5)
            assert Qt.item() == pytest.approx(Q[t].item(), abs=1e-5)


def test_auc():
    assert critic_eval.auc([0.9, 0.8], [0.1, 0.2]) == 1.0
    assert critic_eval.auc([0.1], [0.9]) == 0.0
    assert critic_eval.auc([0.5], [0.5]) == 0.5


def test_correlation_by_hand():
    assert critic_eval.correlation([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert critic_eval.correlation([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # x = (-1, 0, 1), y = (1, -2, 1) after centring: x·y = 0
    assert critic_eval.correlation([0, 1, 2], [1, -2, 1]) == pytest.approx(0.0)
    assert math.isnan(critic_eval.correlation([1, 1], [0, 1]))


def test_first_state_ceiling_by_hand():
    # task a: one success, one failure (rate 1/2); b: two failures (0); c: one success (1). Successes a, c
    # against failures a, b, b: a-a ties (1/2), a beats both b's (2), c beats all three (3): 5.5 / 6.
    tasks, ok = ["a", "a", "b", "b", "c"], [True, False, False, False, True]
    assert critic_eval.first_state_ceiling(tasks, ok) == 5.5 / 6
    # expert success and policy failure on the same task: nothing about the first state tells them apart
    assert critic_eval.first_state_ceiling(["a", "a", "b", "b"], [True, False, True, False]) == 0.5


def test_critic_cli_trains_saves_and_reloads(tiny_policy, sciworld_expert, tmp_path):
    hybrid = tmp_path / "hybrid.jsonl"
    run_script("relabel.py", str(sciworld_expert), "--out", str(hybrid))
    out = tmp_path / "critic"
    proc = run_script("critic.py", "--data", str(hybrid), "--policy", str(tiny_policy), "--out", str(out),
                      "--epochs", "2", "--grad-accum", "1", "--refit-rounds", "20")
    # 4 steps at IQL's tau 0.005 leave Q̄ at 1 - 0.995^4 = 2% of the way to Q: the run says so
    assert "--tau 0.005 over 4 steps moves the target Q head only 2% of the way" in proc.stdout
    scored = common.read_jsonl(out / "scored.jsonl")
    assert all({"value", "q", "advantage"} <= s.keys() for t in scored for s in t["steps"])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4 and all(m["loss_q"] >= 0 for m in metrics)
    scalars = tensorboard_scalars(out)  # the losses as TensorBoard curves, the critic's diagnostics under eval/
    for loss in ("loss_q", "loss_v"):
        assert scalars[f"losses/{loss}"] == [(m["step"], pytest.approx(m[loss], rel=1e-6)) for m in metrics]
    assert {"charts/transitions_per_s", "eval/train_auc_v0"} <= scalars.keys()
    model, heads, tok = critic.load_critic(str(out))
    ids, v_pos, q_pos = critic.encode(tok, scored[0])
    with torch.no_grad():
        V, Q, _ = critic.values(model, heads, ids, v_pos, q_pos)
    torch.testing.assert_close(V, torch.tensor([s["value"] for s in scored[0]["steps"]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(Q, torch.tensor([s["q"] for s in scored[0]["steps"]]), atol=1e-5, rtol=0)
    report = json.loads((out / "eval.json").read_text())
    assert -1 <= report["return_corr_train"] <= 1  # 2 trajectories: none held out, so only the training figure
    # the saved heads are the refitted ones (the reload above matches them), and 20 rounds of fitted IQL converge
    assert report["refit_last_round_change"] < 1e-2 and report["refit_loss_q"] >= 0
    # the advantages are GAE on r_env with these values
    r = torch.tensor([s["env_reward"] for s in scored[0]["steps"]])
    want = critic.gae(r, torch.cat([V, torch.zeros(1)]), 0.99, 0.95)
    torch.testing.assert_close(torch.tensor([s["advantage"] for s in scored[0]["steps"]]), want, atol=1e-5, rtol=0)
    # tools/critic_eval.py scores any file with the checkpoint: on the unlabelled expert file (relabelled on the
    # fly) it finds the fit critic.py reported on the same trajectories
    run_script("tools/critic_eval.py", str(out), str(sciworld_expert), "--out", str(tmp_path / "e.json"))
    again = json.loads((tmp_path / "e.json").read_text())
    assert again["trajectories"] == 2 and again["successes"] == 2 and math.isnan(again["auc_v0"])
    assert again["return_corr"] == pytest.approx(report["return_corr_train"], abs=1e-5)


def test_critic_needs_relabelled_data(tiny_policy, sciworld_expert, tmp_path):
    proc = run_script("critic.py", "--data", str(sciworld_expert), "--policy", str(tiny_policy),
                      "--out", str(tmp_path / "c"), check=False)
    assert proc.returncode == 2 and "no finite 'aux_reward'; relabel.py writes it" in proc.stderr


def _tensors(path):
    from safetensors.torch import load_file
    return load_file(str(path))


def test_the_exact_fit_changes_the_heads_and_nothing_else(tiny_policy, sciworld_expert, tmp_path):
    hybrid = tmp_path / "hybrid.jsonl"
    run_script("relabel.py", str(sciworld_expert), "--out", str(hybrid))
    for rounds in ("0", "20"):
        run_script("critic.py", "--data", str(hybrid), "--policy", str(tiny_policy), "--out", str(tmp_path / rounds),
                   "--epochs", "1", "--grad-accum", "1", "--refit-rounds", rounds)
    plain, fitted = (tmp_path / "0", tmp_path / "20")
    a, b = (_tensors(d / "critic" / "adapter_model.safetensors") for d in (plain, fitted))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same LoRA training
    losses = [[{k: v for k, v in json.loads(line).items() if k != "transitions_per_s"}
               for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (plain, fitted)]
    assert losses[0] == losses[1]
    ha, hb = _tensors(plain / "heads.safetensors"), _tensors(fitted / "heads.safetensors")
    assert not torch.equal(ha["v.weight"], hb["v.weight"]) and torch.equal(hb["q.weight"], hb["q_target.weight"])
    assert "refit_loss_q" in json.loads((fitted / "eval.json").read_text())
    assert "refit_loss_q" not in json.loads((plain / "eval.json").read_text())


def test_heldout_trajectories_are_scored_but_not_trained_on(tiny_policy, sciworld_expert, tmp_path):
    # 10 trajectories (five copies of the two expert ones), 2 held out: 8 optimizer steps, all 10 scored
    trajs = common.read_jsonl(sciworld_expert)
    hybrid = tmp_path / "hybrid.jsonl"
    copies = [{**t, "id": f"{t['id']}#{k}"} for k in range(5) for t in trajs]
    common.write_jsonl(tmp_path / "copies.jsonl", copies)
    run_script("relabel.py", str(tmp_path / "copies.jsonl"), "--out", str(hybrid))
    for frac in ("0", "0.2"):
        run_script("critic.py", "--data", str(hybrid), "--policy", str(tiny_policy), "--out", str(tmp_path / frac),
                   "--epochs", "1", "--grad-accum", "1", "--heldout-frac", frac)
    for frac, trained, held in (("0", 10, 0), ("0.2", 8, 2)):
        report = json.loads((tmp_path / frac / "eval.json").read_text())
        assert (report["train"], report["heldout"]) == (trained, held)
        assert len((tmp_path / frac / "metrics.jsonl").read_text().splitlines()) == trained
        assert len(common.read_jsonl(tmp_path / frac / "scored.jsonl")) == 10
