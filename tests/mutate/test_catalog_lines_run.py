"""Every catalog entry edits code that its presets run: the mutation runner's clean run of the entries' killers,
on a copy of the package probed at the edited functions (gates/mutation/line_probe.py), executes at least one edited
line of every entry on every preset the entry names. A mutant whose line never runs there is absent, not killed."""

from __future__ import annotations

import pytest

from k3verify.checkpoint.synthetic import default_cache_root
from k3verify.commands.mutate import registered_check_ids
from k3verify.gates.mutation.line_probe import absent_on, spans
from k3verify.gates.mutation.runner import PACKAGE_DIR, PARITY_RAN, load_catalog, select

XDIST_SPREAD = True  # one long probed run per preset: handed to the workers one by one (tests/conftest.py)
PAIRS = [(m, p) for m, p in select(load_catalog()) if not m.equivalent]
PRESETS = sorted({p for _, p in PAIRS})


@pytest.mark.parametrize("preset", PRESETS)
def test_every_entry_runs_an_edited_line_on_its_presets(preset: str) -> None:
    """The probed clean run on `preset` executes an edited line of each entry that names it."""
    mutants = [m for m, p in PAIRS if p == preset]
    # No mutant here, so the run may share the synthetic checkpoints every other test builds.
    gone, child = absent_on(mutants, preset, registered_check_ids(), cache_dir=default_cache_root())
    assert child.report is not None and child.returncode in PARITY_RAN, child.output[-3000:]
    assert not gone, "\n".join(f"{mutant_id} is absent on {preset}: {why}" for mutant_id, why in sorted(gone.items()))


def test_a_module_constant_is_in_play_where_a_function_reads_it() -> None:
    """A constant's entry is watched through the functions that read it (the MLA LoRA norms' eps: MLA's
    __init__), an edit inside a function through its own lines."""
    by_id = {m.id: m for m in load_catalog()}
    (eps,) = spans(by_id["mla.lora_norm.eps_1e5"], PACKAGE_DIR.parent)
    source = (PACKAGE_DIR.parent / eps.path).read_text().splitlines()
    assert eps.watch and all("def __init__" in source[a - 1] for a, _ in eps.watch)
    shared = spans(by_id["moe.shared_expert_dropped"], PACKAGE_DIR.parent)
    assert [s.watch for s in shared] == [((s.first, s.last),) for s in shared] and len(shared) == 2
