"""The claims ledger (scripts/claims.py): every sentence it lists is where it says, every claim
that speaks for a laptop's CPU holds on the committed outputs, no claim the GPU record judges on
its current sentence is false there, and every predicate fails on figures doctored to make its
sentence false (a predicate that cannot fail checks nothing). Nothing here times anything."""

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import claims  # noqa: E402
import colab_runtime  # noqa: E402
import gpu_figures  # noqa: E402

COMMITTED = claims.committed_notebooks()
CPU_VALUES = claims.figures_of_notebooks(COMMITTED)
RECORD = json.loads(claims.GPU_RECORD.read_text(encoding="utf-8"))
GPU_VALUES = claims.figures_of_record(RECORD)
ALL_LABELS = {f.label for f in gpu_figures.FIGURES + gpu_figures.SERVER_FIGURES}


def _ids(claim):
    return claim.id


def test_claim_ids_are_unique():
    ids = [c.id for c in claims.CLAIMS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.parametrize("claim", claims.CLAIMS, ids=_ids)
def test_every_claim_finds_its_sentence_and_its_figures(claim):
    said = claims.sentence(claim)
    assert claims._flat(claim.words) in said
    assert claim.records and claim.records <= claims.ALL
    assert set(claim.figures) <= ALL_LABELS, set(claim.figures) - ALL_LABELS


@pytest.mark.parametrize("claim", [c for c in claims.CLAIMS if "cpu" in c.records], ids=_ids)
def test_every_cpu_claim_holds_on_the_committed_outputs(claim):
    verdict = claims.judge(claim, CPU_VALUES, "cpu")
    assert verdict.status == claims.HOLDS, (
        f"{verdict.line()} [outputs recorded with {'; '.join(claims.versions_of(COMMITTED))}, "
        f"lessons/ last changed in {claims.last_change('lessons')}]")


def test_the_gpu_record_names_its_commit_and_versions_and_no_current_claim_is_false():
    assert RECORD.get("commit") and RECORD.get("versions", {}).get("torch")
    verdicts = claims.gpu_verdicts(RECORD)
    assert {v.claim.id for v in verdicts} == {c.id for c in claims.CLAIMS if "gpu" in c.records}
    wrong = [v.line() for v in verdicts if v.status == claims.FALSE and not v.stale]
    assert not wrong, "\n".join(wrong)


def test_the_records_verdicts_are_the_ledgers():
    """docs/gpu-run.json keeps a verdict for every GPU claim (run_lessons_gpu.py --claims
    writes them again after the ledger or a sentence changes)."""
    kept = {e["id"]: e for e in RECORD.get("claims", [])}
    for v in claims.gpu_verdicts(RECORD):
        assert v.claim.id in kept, f"{v.claim.id}: not judged in docs/gpu-run.json"
        assert kept[v.claim.id]["verdict"] == v.status, v.line()


# --- the predicates against claims made false on purpose --------------------------------------

def _doctored(value: str):
    """Values like ``value`` with one number scaled, or one word swapped for its opposite."""
    spans = [m.span() for m in claims._NUMBER.finditer(value)]
    for start, end in spans:
        number = float(value[start:end].replace(",", ""))
        for factor in (0, 0.2, 0.6, 0.95, 1.05, 1.6, 5, 100):
            yield value[:start] + f"{number * factor:.4g}" + value[end:]
    for word, other in (("overhead", "arithmetic"), ("arithmetic", "overhead"),
                        ("True", "False")):
        if word in value:
            yield value.replace(word, other, 1)


def _falsified(claim, values):
    """The first doctored figure that makes the claim false: (label, value), or None."""
    for label in claim.figures:
        for value in _doctored(values[label]):
            if claims.judge(claim, {**values, label: value}, "cpu").status == claims.FALSE:
                return label, value
    return None


@pytest.mark.parametrize("claim", claims.CLAIMS, ids=_ids)
def test_every_predicate_fails_on_a_doctored_figure(claim):
    record, values = ("cpu", CPU_VALUES) if "cpu" in claim.records else ("gpu", GPU_VALUES)
    assert claims.judge(claim, values, record).status == claims.HOLDS
    found = _falsified(claim, values)
    assert found, f"{claim.id}: no doctored figure makes its predicate fail ({claim.says})"
    label, value = found
    line = claims.judge(claim, {**values, label: value}, record).line()
    assert claim.id in line and value in line and label in line
    assert claims.sentence(claim) in line


def test_a_figure_missing_from_a_record_is_no_evidence_not_a_verdict():
    claim = next(c for c in claims.CLAIMS if c.id == "02-cpu-costs-add-up")
    values = {**CPU_VALUES, claims.L02_TPOT: gpu_figures.NOT_FOUND}
    assert claims.judge(claim, values, "cpu").status == claims.NO_EVIDENCE
    assert claims.judge(claim, {**CPU_VALUES, claims.L02_TPOT: "4.6 ms"}, "cpu").status == \
        claims.NO_EVIDENCE


def _doctor_cell(nb, marker, old, new):
    nb = copy.deepcopy(nb)
    cell = gpu_figures.cells_with(nb, marker)[0]
    for out in cell["outputs"]:
        if out.get("output_type") == "stream":
            text = gpu_figures._text(out["text"])
            if old in text:
                out["text"] = text.replace(old, new)
                return nb
    raise AssertionError(f"{old!r} not printed by the cell with {marker!r}")


def test_a_doctored_run_fails_the_colab_check_naming_claim_sentence_and_figure():
    """make test-colab's check, on lesson 03 as if continuous batching had needed as many
    decode steps as static batching: the sentence that says otherwise is false."""
    doctored = _doctor_cell(COMMITTED["03"], "ideal_decode_steps(asked, BATCH_SIZE)",
                            "step ratio: 3.14x", "step ratio: 1.00x")
    wrong, judged = colab_runtime.claims_failures({**COMMITTED, "03": doctored})
    assert judged == len([c for c in claims.CLAIMS if "colab" in c.records])
    named = [line for line in wrong if "03-far-fewer-steps" in line]
    assert named, wrong
    assert "1.00x" in named[0] and claims.L03_STEPS in named[0]
    assert "It needs far fewer decode steps" in named[0]
    assert colab_runtime.claims_failures(COMMITTED) == ([], judged)


def test_the_colab_run_judges_no_claim_that_rests_on_a_time():
    """Two notebooks at once on CI's cores: the run's times measure the contention, so only the
    claims on counts, sizes and tokens speak for it (a time is judged on the quiet recording)."""
    colab = [c for c in claims.CLAIMS if "colab" in c.records]
    assert colab and all(set(c.figures) <= claims.NOT_TIMES for c in colab)
    timed = next(c for c in claims.CLAIMS if c.id == "02-cpu-costs-add-up")
    assert timed.records == {"cpu"}


def test_a_run_of_some_lessons_judges_only_their_claims():
    verdicts = claims.run_verdicts({"08": COMMITTED["08"]}, "colab")
    assert verdicts and all(claims.lessons_of(v.claim) == {"08"} for v in verdicts)
    assert all(v.status == claims.HOLDS for v in verdicts)


def test_a_doctored_gpu_record_makes_the_launch_claims_false():
    record = copy.deepcopy(RECORD)
    topic = record["topics"]["lesson 10, CUDA graphs"]
    record["topics"]["lesson 10, CUDA graphs"] = [
        line.replace("one replayed step: 2 launches", "one replayed step: 9 launches")
        for line in topic]
    for row in record["figures"]["10"]["rows"]:
        if row["label"] == claims.L10_LAUNCHES:
            row["gpu"] = "120 → 9"
    false = {v.claim.id for v in claims.gpu_verdicts(record) if v.status == claims.FALSE}
    assert {"10-summary-launches", "readme-10-launches", "guide-10-launches"} <= false


# --- where the sentences are, and when the GPU evidence is stale ------------------------------

def test_a_sentence_that_changed_is_not_found_and_the_ledger_says_which_claim():
    claim = next(c for c in claims.CLAIMS if c.where == "02")
    moved = claims.Claim(claim.id, claim.where, claim.anchor, "a sentence nobody wrote",
                         claim.figures, claim.holds, claim.says, claim.records)
    with pytest.raises(LookupError, match=claim.id):
        claims.sentence(moved)
    lost = claims.Claim("lost", "02", "no-such-cell", "x", (), lambda f: True, "")
    with pytest.raises(LookupError, match="no-such-cell"):
        claims.sentence(lost)


def test_sentence_in_stops_at_sentence_list_and_table_ends():
    text = ("First one. The cache saves time here. Next. - an item that says it | a cell "
            "with more words | end")
    assert claims.sentence_in(text, "saves time") == "The cache saves time here."
    assert claims.sentence_in(text, "item that") == "an item that says it"
    assert claims.sentence_in(text, "with more") == "a cell with more words"
    assert claims.sentence_in(text, "absent") is None


def test_gpu_evidence_is_stale_when_its_sentence_changed():
    gpu_claims = [c for c in claims.CLAIMS if "gpu" in c.records]
    current = [{"id": c.id, "sentence": claims.sentence_hash(claims.sentence(c))}
               for c in gpu_claims]
    record = {**RECORD, "claims": current}
    assert not any(v.stale for v in claims.gpu_verdicts(record))
    older = [{**e, "sentence": claims.sentence_hash("what the sentence said before")}
             if e["id"] == gpu_claims[0].id else e for e in current]
    stale = [v.claim.id for v in claims.gpu_verdicts({**RECORD, "claims": older}) if v.stale]
    assert stale == [gpu_claims[0].id]
    # an older record without hashes: by its commit; one that names none is stale throughout
    nameless = {k: v for k, v in RECORD.items() if k not in ("claims", "commit")}
    assert all(v.stale for v in claims.gpu_verdicts(nameless))


def test_numbers_read_figures_as_the_tables_show_them():
    assert claims.numbers("x4.1 (8.82 → 36.23 ms)") == [4.1, 8.82, 36.23]
    assert claims.numbers("8, 8,192 bytes") == [8, 8192]
    assert claims.numbers("1.45–1.97x") == [1.45, 1.97]
    assert claims.numbers("overhead / arithmetic") == []
    f = claims.Figures({"a": "3.238 / 2.313 / 0.614 ms", "b": "not found"},
                       "took 0.614 ms (eager 3.238 ms, compiled 2.313 ms)")
    assert f.quoted("a") and f("a", 2) == 0.614
    assert not claims.Figures(f.values, "took 0.61 ms").quoted("a")
    with pytest.raises(claims.Missing):
        f("b")
    with pytest.raises(claims.Missing):
        f("a", 3)


def test_counts_list_every_place():
    lines = claims.counts()
    total = lines[-1].split()
    assert int(total[1]) == len(claims.CLAIMS)
    assert int(total[4]) == sum("gpu" in c.records for c in claims.CLAIMS)
