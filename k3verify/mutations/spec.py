"""Speculative decoding faults: the KDA score records, the commit of the accepted prefix, acceptance, the captured
score step."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

REF = "k3verify.kernels.kda.score_ref"
ARENA = "k3verify.serving.spec.arena"
ACCEPT = "k3verify.serving.spec.accept"
MLA = "k3verify.serving.layers.mla"
KERNELS = "k3verify.kernels.kda.score_kernel"
GRAPHS = "k3verify.serving.spec.score_graphs"
OFFLINE = "k3verify.serving.spec.offline"
PRESETS = ("k3-tiny", "kl-tiny")

MUTANTS = [
    Mutant(
        id="spec.record.index_off_by_one", quick=True,
        fault="the recording recurrence stores the state after position j in record j-1 (record 0 wraps to the last)",
        target=f"{REF}:kda_record_torch",
        old="        records[:, j] = state\n",
        new="        records[:, j - 1] = state\n",
        killers=("spec.records.vs_sequential", "spec.greedy.vs_plain"), presets=PRESETS,
    ),
    Mutant(
        id="spec.rider.fillers_emitted",
        fault="a row riding along in a score pass emits its filler drafts as if the model had accepted them",
        target=f"{OFFLINE}:_round",
        old="            run.tokens[i].extend(a.tokens)\n",
        new="            run.tokens[i].extend(a.tokens if r < drafted else a.tokens + rows[r][1])\n",
        killers=("spec.greedy.vs_plain",), presets=PRESETS,
    ),
    Mutant(
        id="spec.commit.rejected_drafts_committed", quick=True,
        fault="the commit copies the state after the last draft into the slot, whatever was accepted",
        target=f"{ARENA}:commit_accepted",
        old="pool.state[:, slots] = arena.state[:, rows, accepted]",
        new="pool.state[:, slots] = arena.state[:, rows, n - 1]",
        killers=("spec.commit.accepted_prefix", "spec.greedy.vs_plain"), presets=PRESETS,
    ),
    Mutant(
        id="spec.commit.conv_window_not_rolled_back",
        fault="the commit rolls the recurrent state back to the accepted position but keeps the conv windows of "
              "the last draft",
        target=f"{ARENA}:commit_accepted",
        old="windows = arena.conv[:, rows, accepted]",
        new="windows = arena.conv[:, rows, n - 1]",
        killers=("spec.commit.accepted_prefix", "spec.greedy.vs_plain"), presets=PRESETS,
    ),
    Mutant(
        id="spec.commit.mla_not_rolled_back",
        fault="latents the score wrote at rejected positions stay in the MLA cache",
        target=f"{ARENA}:commit_accepted",
        old="flat[:, latent_rows] = torch.where(rejected[None, :, None], arena.latents[:, : B * n], written)",
        new="flat[:, latent_rows] = written",
        killers=("spec.commit.accepted_prefix",), presets=PRESETS,
    ),
    Mutant(
        id="spec.accept.device_count_one_more",
        fault="greedy acceptance on the device (what the offline round commits) counts one draft more than matched",
        target=f"{ACCEPT}:greedy_counts",
        old="return (best[:, :k] == drafts).long().cumprod(dim=1).sum(dim=1)",
        new="return ((best[:, :k] == drafts).long().cumprod(dim=1).sum(dim=1) + 1).clamp(max=k)",
        killers=("spec.greedy.vs_plain",), presets=PRESETS,
    ),
    Mutant(
        id="spec.engine.launch_ahead_not_drained",
        fault="the engine goes from launch-ahead plain steps (the cost policy declining) to an in-order speculative "
              "step without reading the step in flight first: the drafter and the score see a stale last token",
        target="k3verify.serving.engine_loop:EngineLoop._step_in_order",
        old="        if self.in_flight is not None:  # after launch-ahead steps: the drafter needs every token",
        new="        if False:  # after launch-ahead steps: the drafter needs every token",
        killers=("spec.engine.gated_vs_plain",), presets=PRESETS,
    ),
    Mutant(
        id="spec.accept.bonus_dropped",
        fault="greedy acceptance emits the accepted drafts but drops the bonus token after them",
        target=f"{ACCEPT}:accept_greedy_ids",
        old="return Accepted(a, drafts[:a] + [best[a]])",
        new="return Accepted(a, drafts[:a] if a else [best[a]])",
        killers=("spec.greedy.vs_plain",), presets=PRESETS,
    ),
    Mutant(
        id="spec.mla.verify_context_cut",
        fault="MLA's cached-context rows stop at the first score token: later draft positions do not see the "
              "earlier ones",
        target=f"{MLA}:decode_rows",
        old="L = int(max(b.start_list)) + max(b.seq_lens)",
        new="L = int(max(b.start_list)) + 1",
        killers=("spec.verify.logits", "spec.greedy.vs_plain"), presets=PRESETS,
    ),
    Mutant(
        id="spec.graph.refill_after_replay",
        fault="the captured score step is replayed before the live rows are copied into its static inputs: each "
              "replay scores the previous pack (the first one the capture's scratch rows)",
        target=f"{GRAPHS}:ScoreGraphs.score",
        old="        inputs.fill(ids, slots, tables, starts, n, self.staging)\n        graph.replay()\n",
        new="        graph.replay()\n        inputs.fill(ids, slots, tables, starts, n, self.staging)\n",
        killers=("spec.verify.graph_vs_eager",), presets=PRESETS,
    ),
    Mutant(
        id="spec.fused.writes_pool_state", devices=("cuda",),
        fault="the fused score kernel writes its running state back into the pool slot, as a decode kernel does: "
              "the state after every draft, rejected ones included, lands in the cache before acceptance is known",
        target=f"{KERNELS}:kda_score_fused_kernel",
        old="    # every thread's o stores, then one acq_rel ticket",
        new="    tl.store(state_ptr + ((slot * H + h) * DK + i[None, :]) * DV + vv[:, None], S, mask=m2)\n"
            "    # every thread's o stores, then one acq_rel ticket",
        killers=("spec.fused.vs_unfused",), presets=("k3-syn-25",),
    ),
]
