"""The probe's calibration (issue 24 item 4): the difficulty knobs, the band logic and its early stop against
brute force, the search on planted accuracy tables, held-out documents on a tiny random model (accuracies
re-scored independently), and the verdict's wording when the ceiling cannot be left."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pandas as pd
import pytest
import tiny_models as tm
import torch
from test_interventions_probe import planted_trials, prose

from qk_core.config.options import InterventionOptions, InterventionOptionsError
from qk_core.interventions.calibrate import (
    CALIBRATION_STREAM,
    Calibration,
    Setting,
    Tried,
    band_state,
    calibrate,
    calibration_trials,
    held_out,
    ladder,
    search,
)
from qk_core.interventions.hook import Intervention, InterventionSession
from qk_core.interventions.model import backbone_of
from qk_core.interventions.probe import NEEDLE, build_trial, candidate_ids, near_codes, score_trial, trial_outcome
from qk_core.interventions.verdict import verdicts
from qk_core.stats.intervals import wilson

torch.set_num_threads(min(2, torch.get_num_threads()))
BAND = (0.4, 0.9)


def test_near_distractors_and_decoys_are_built_to_spec() -> None:
    tok = tm.byte_tokenizer()
    text = prose(300, 1)
    plain = build_trial(tok, 5, text, 0.5, window=1500, K=10, seed=2)
    t = build_trial(tok, 5, text, 0.5, window=1500, K=10, seed=2, distractors="near", decoys=3)
    assert t.codes[0] == plain.codes[0] and t.name == plain.name  # the same draw, then the knobs
    assert len(set(t.codes)) == 10
    for c in t.codes[1:]:
        assert len(c) == 5 and c[0] != "0" and sum(a != b for a, b in zip(c, t.codes[0], strict=True)) == 1
    assert len(near_codes("10000")) == 44 and len(set(near_codes("55555"))) == 44
    prompt = tok.decode(t.ids, skip_special_tokens=True)
    assert len(t.decoys) == 3 and len(set(t.decoys)) == 3 and t.name not in t.decoys
    first, last = t.name.split(" ")
    for i, (name, code) in enumerate(zip(t.decoys, t.codes[1:4], strict=True)):
        assert prompt.count(NEEDLE.format(name=name, code=code).strip()) == 1
        assert name.startswith(first + " ") if i % 2 == 0 else name.endswith(" " + last)
    assert prompt.count(NEEDLE.format(name=t.name, code=t.codes[0]).strip()) == 1
    assert len(t.ids) + max(map(len, candidate_ids(tok, t.codes))) <= 1500
    assert abs(t.depth_tokens - 0.5) < 0.05
    again = build_trial(tok, 5, text, 0.5, window=1500, K=10, seed=2, distractors="near", decoys=3)
    assert again.ids == t.ids  # seeded
    other = build_trial(tok, 5, text, 0.5, window=1500, K=10, seed=2, stream=CALIBRATION_STREAM)
    assert (other.name, other.codes) != (plain.name, plain.codes)  # the calibration's own stream
    with pytest.raises(InterventionOptionsError, match="decoys"):
        InterventionOptions(candidates=4, decoys=4)
    with pytest.raises(InterventionOptionsError, match="target_band"):
        InterventionOptions(target_band=(0.9, 0.4))


def test_ladder_is_the_documented_order() -> None:
    base = Setting(512, 10)
    assert ladder(base, "harder", 2048, 20) == [
        Setting(512, 10, "near", 0), Setting(512, 10, "near", 1), Setting(512, 10, "near", 3),
        Setting(512, 10, "near", 9), Setting(1024, 10, "near", 9), Setting(2048, 10, "near", 9),
        Setting(2048, 20, "near", 19)]
    assert ladder(Setting(512, 10, "near", 3), "easier", 2048, 20) == [
        Setting(512, 10, "near", 1), Setting(512, 10, "near", 0), Setting(512, 10, "random", 0),
        Setting(256, 10, "random", 0), Setting(128, 10, "random", 0), Setting(64, 10, "random", 0)]
    assert ladder(Setting(2048, 20, "near", 19), "harder", 2048, 20) == []  # already the hardest


def test_band_state_equals_brute_force_over_every_completion() -> None:
    for n in (1, 5, 8):
        for done in range(n + 1):
            for correct in range(done + 1):
                finals = set()
                for rest in range(n - done + 1):  # every number of further correct trials
                    acc = (correct + rest) / n
                    finals.add("above" if acc > BAND[1] else "below" if acc < BAND[0] else "inside")
                want = finals.pop() if len(finals) == 1 else "open"
                assert band_state(correct, done, n, BAND) == want, (n, done, correct)


def planted(table: dict[Setting, list[bool]], reads: dict[Setting, int]):
    """An evaluator of hand-made score arrays: a trial's correct code scores 0, its best distractor -1
    (wrong: +1); ``reads`` counts the arrays the search actually read."""

    def evaluate(s: Setting):
        for ok in table[s]:
            reads[s] = reads.get(s, 0) + 1
            yield np.array([0.0, -1.0 if ok else 1.0, -5.0])

    return evaluate


def test_search_on_planted_accuracy_tables() -> None:
    base = Setting(512, 10)
    steps = [base, *ladder(base, "harder", 2048, 20)]
    n = 8

    def run(accs: list[int], budget: int = 200, first_wrong: bool = False) -> tuple[Calibration, dict]:
        table = {s: ([False] * (n - a) + [True] * a) if first_wrong else ([True] * a + [False] * (n - a))
                 for s, a in zip(steps, accs, strict=True)}
        reads: dict[Setting, int] = {}
        return search(base, planted(table, reads), n, BAND, budget, 2048, 20), reads

    # correct per 8 trials along the ladder: the first inside the band [0.4, 0.9] (4..7 of 8) is chosen
    cal, reads = run([8, 8, 8, 6, 2, 1, 0, 0])
    assert cal.status == "inside" and cal.chosen == steps[3] and [t.setting for t in cal.tried] == steps[:4]
    assert reads[steps[0]] == 8  # 8 of 8 right: only the last trial decides "above"
    # 6 right then 1 wrong: the final lies in {6/8, 7/8}, both inside -> the setting stops after 7 trials
    assert reads[steps[3]] == 7 and cal.tried[3].n_trials == 7 and cal.tried[3].state == "inside"
    assert cal.tried[3].accuracy == 6 / 7
    # early stop below: wrong answers first, 5 wrong of 8 cannot reach 4 right
    cal, reads = run([8, 2, 0, 0, 0, 0, 0, 0], first_wrong=True)
    assert cal.status == "outside" and reads[steps[1]] == 5 and cal.tried[1].state == "below"
    assert cal.chosen == steps[0]  # 1.00 lies 0.10 above the band, 0 of 5 right 0.40 below it
    # the ceiling: every step above the band -> the hardest setting, and the budget limits the steps
    cal, _ = run([8] * 8)
    assert cal.status == "ceiling" and cal.chosen == steps[-1] and len(cal.tried) == 8
    cal, _ = run([8] * 8, budget=40)
    assert cal.status == "ceiling" and len(cal.tried) == 5 and cal.chosen == steps[4] and cal.trials_used == 40
    s = cal.statement()
    assert s.startswith("the probe could not be made hard enough: baseline accuracy 1.00 [0.68, 1.00] on 8 "
                        "calibration trials") and "window 512, K = 10, near distractors, 9 decoys" in s
    assert "40 of at most 40 calibration trials" in s
    # the floor: the configured setting below the band walks the easier ladder
    easy = [base, *ladder(base, "easier", 2048, 20)]
    reads = {}
    cal = search(base, planted({s: [False] * n for s in easy}, reads), n, BAND, 200, 2048, 20)
    assert cal.status == "floor" and cal.chosen == Setting(64, 10) and all(v == 5 for v in reads.values())
    assert "could not be made easy enough" in cal.statement()
    # inside at once: nothing else is tried
    cal, _ = run([5, 8, 8, 8, 8, 8, 8, 8])
    assert cal.status == "inside" and len(cal.tried) == 1 and cal.chosen == base


def test_calibration_on_a_tiny_model_uses_held_out_documents_only() -> None:
    model = tm.tiny_model("llama")
    bb = backbone_of(model)
    tok = tm.byte_tokenizer()
    corpus = pd.DataFrame({"example_id": [11, 12, 13, 14, 15], "text": [prose(60, s) for s in range(5)]})
    opts = InterventionOptions(window=200, depths=(0.2, 0.7), n_docs=2, calibration_docs=2, calibration_trials=12,
                               max_candidates=4, candidates=3, max_window=256)
    ho = held_out(corpus, opts)
    assert ho["example_id"].tolist() == [13, 14]
    assert not set(ho["example_id"]) & set(corpus.head(opts.n_docs)["example_id"])

    def score(trial):
        with InterventionSession(bb, Intervention()):
            return score_trial(model, trial, candidate_ids(tok, trial.codes))

    cal = calibrate(score, tok, corpus, opts, 200, 256)
    assert cal.documents == (13, 14) and cal.trials_used <= 12 and cal.tried[0].setting == Setting(200, 3)
    assert cal.status in ("inside", "ceiling", "floor", "outside")
    table = cal.table()
    for t, row in zip(cal.tried, table.itertuples(), strict=True):
        if t.error:  # a setting whose prompt does not fit its window ends the search
            assert row.state.startswith("cannot be built") and t is cal.tried[-1]
            continue
        # re-score the setting's trials independently: a full forward of prompt + each continuation
        trials = list(itertools.islice(calibration_trials(tok, ho, t.setting, opts), t.n_trials))
        assert {tr.doc_id for tr in trials} <= {13, 14}
        right = 0
        for tr in trials:
            cands = candidate_ids(tok, tr.codes)
            with torch.inference_mode():
                full = []
                for c in cands:
                    lp = torch.log_softmax(model(input_ids=torch.tensor([tr.ids + c])).logits[0].double(), -1)
                    full.append(sum(float(lp[len(tr.ids) - 1 + i, x]) for i, x in enumerate(c)))
            right += trial_outcome(np.array(full))["correct"]
        assert right == t.correct == row.correct
        assert (row.accuracy_lo, row.accuracy_hi) == pytest.approx(wilson(right, t.n_trials))
        # the band logic: the recorded state is that of the accuracy (decided early or over all trials)
        acc_state = "above" if row.accuracy > BAND[1] else "below" if row.accuracy < BAND[0] else "inside"
        assert row.state == acc_state or t.n_trials < t.n_planned
    states = [t.state for t in cal.tried if not t.error]
    if cal.status == "inside":
        assert states[-1] == "inside" and cal.chosen == cal.tried[-1].setting
    elif cal.status in ("ceiling", "floor"):
        assert set(states) == {"above" if cal.status == "ceiling" else "below"}
    assert table["chosen"].sum() == 1


def test_verdict_says_plainly_when_the_ceiling_cannot_be_left() -> None:
    opts = InterventionOptions(bootstrap=200)
    tr = planted_trials()
    tr.loc[tr["depth"] == 0.9, "depth"] = 0.3
    tr["correct"] = tr["correct"].astype(bool)
    tr.loc[tr["intervention"] == "baseline", "correct"] = True  # the baseline at the ceiling
    hardest = Setting(2048, 20, "near", 19)
    cal = Calibration(Setting(512, 10), hardest, "ceiling", BAND, documents=(7, 8, 9, 10), budget=48,
                      max_window=2048, max_candidates=20)
    cal.tried = [Tried(Setting(512, 10), 8, 8, 8, state="above"), Tried(hardest, 8, 8, 8, state="above")]
    v = verdicts(tr, tr.iloc[0:0], opts, None, cal)
    h1 = v[v["hypothesis"].str.startswith("H1")]
    assert len(h1) and (h1["verdict"] == "not testable").all()
    s = h1.iloc[0]["statement"]
    assert "not testable here: the probe could not be made hard enough: baseline accuracy 1.00 [0.76, 1.00] on " \
           "the study's 12 trials; 1.00 [0.68, 1.00] on 8 calibration trials of 4 held-out documents at the " \
           "hardest setting tried (window 2048, K = 20, near distractors, 19 decoys; 2 settings" in s
    assert re.search(r"stays above the target band \[0.40, 0.90\]", s)
    assert "contrast" in s  # the contrast's value is still shown, but no verdict rests on it
    # calibrated inside the band: the H1 verdict is the data's, the calibration is cited as evidence
    ok = Calibration(Setting(512, 10), Setting(512, 10, "near", 3), "inside", BAND, documents=(7,), budget=48,
                     max_window=2048, max_candidates=20)
    ok.tried = [Tried(Setting(512, 10, "near", 3), 8, 8, 5, state="inside")]
    v2 = verdicts(planted_trials().assign(depth=lambda d: d["depth"].where(d["depth"] < 0.5, 0.3)),
                  tr.iloc[0:0], opts, None, ok)
    assert v2.iloc[0]["verdict"] == "supported" and "probe calibrated on held-out documents" in v2.iloc[0]["evidence"]


def test_report_shows_the_calibration_in_the_interventions_section() -> None:
    from qk_core.report.html import ReportInputs, render_report

    hard = Setting(512, 10, "near", 3)
    cal = Calibration(Setting(512, 10), hard, "inside", BAND, documents=(13, 14), budget=48, max_window=2048,
                      max_candidates=20)
    cal.tried = [Tried(Setting(512, 10), 8, 8, 8, state="above"), Tried(hard, 8, 8, 6, state="inside")]
    study = planted_trials()
    study.loc[(study["intervention"] == "baseline") & (study["doc_id"] < 2), "correct"] = False
    table = cal.table(study)
    assert table["phase"].tolist() == ["calibration", "calibration", "study"]
    assert table["chosen"].tolist() == [False, True, True] and table.iloc[2]["accuracy"] == 8 / 12
    assert table.iloc[2]["documents"] == "0, 1, 2, 3, 4, 5" and table.iloc[0]["documents"] == "13, 14"
    page = render_report(ReportInputs(title="t", models=[], tables={"intervention_calibration": {"m": table}},
                                      figures=[], states=[], defined_assets=["intervention_calibration"]))
    sec = page[page.index('<section id="interventions"'):]
    sec = sec[:sec.index("</section>")]
    assert "m: probe calibration" in sec and "window 512, K = 10, near, 3 decoys" in sec
    assert "6 / 8" in sec and "0.6667" in sec and "[0.3906, 0.8619]" in sec and "held-out: 13, 14" in sec
