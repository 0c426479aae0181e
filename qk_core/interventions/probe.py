"""The retrieval probe (SPEC 11.1): a needle "The pass code of <name> is <code>." at a token depth of a
corpus document, a question at the end, and the correct code ranked among K candidates by sequence
log-probability from one forward of the prompt plus one cached forward of all K continuations.

Two difficulty knobs beyond SPEC 11.1 (issue 24 item 4, chosen by :mod:`qk_core.interventions.calibrate`):
``near`` distractors (each differs from the correct code in one digit) and ``decoys``: the first that many
distractor codes are also inserted into the haystack as needles of other names, each sharing the first or
the last name with the asked one, at seeded relative positions (sentence boundaries where one is near).
With ``random`` distractors and no decoys a trial is the SPEC 11.1 trial, bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

FIRST = ("Ada", "Boris", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kamala",
         "Lars", "Mira", "Nikolai", "Olga", "Pavel", "Quentin", "Rosa", "Stefan", "Tomas", "Ursula", "Viktor",
         "Wanda", "Xavier", "Yara", "Zoltan")
LAST = ("Abbott", "Brennan", "Castillo", "Dubois", "Eriksen", "Fischer", "Galloway", "Hartmann", "Ivanova",
        "Jansen", "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov", "Quinn", "Rossi", "Schneider",
        "Tanaka", "Ulrich", "Varga", "Whitaker", "Yilmaz", "Zeller")
NEEDLE = "The pass code of {name} is {code}. "
QUESTION = "\nWhat is the pass code of {name}? The pass code of {name} is"
_BOUNDARY = re.compile(r"[.!?][\"')\]]?\s+")
PROBE_STREAM = 0x11_1  # RNG stream of the probe (SPEC 11.1)


class ProbeError(ValueError):
    """A trial that cannot be built (names the document and why)."""


@dataclass
class Trial:
    """One prompt: document, nominal depth, needle, the K candidate codes (index 0 is correct)."""

    doc_id: int
    depth: float  # nominal relative depth delta
    seed: int
    name: str
    codes: list[str]
    ids: list[int]  # the prompt's token ids (with the tokenizer's special tokens)
    needle_token: int  # index of the needle's first token in ids
    snapped: bool  # inserted at a sentence boundary
    decoys: tuple[str, ...] = ()  # names of the decoy needles (their codes are codes[1 : 1 + len(decoys)])

    @property
    def depth_tokens(self) -> float:
        """Measured depth: needle start / prompt length, in tokens of the final prompt."""
        return self.needle_token / len(self.ids)


def trial_rng(seed: int, doc_id: int, depth: float, rep: int, stream: int = PROBE_STREAM) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(stream), int(doc_id), round(depth * 1000), int(rep)])


def near_codes(code: str) -> list[str]:
    """Every 5-digit code that differs from ``code`` in exactly one digit (no leading 0), in a fixed order."""
    out = []
    for i, d in enumerate(code):
        for x in "0123456789":
            if x != d and not (i == 0 and x == "0"):
                out.append(code[:i] + x + code[i + 1:])
    return out


def draw_needle(rng: np.random.Generator, K: int, distractors: str = "random") -> tuple[str, list[str]]:
    """A name and K distinct 5-digit codes (the first is the correct one); ``near``: the K - 1 distractors
    differ from the correct code in one digit each."""
    name = f"{FIRST[rng.integers(len(FIRST))]} {LAST[rng.integers(len(LAST))]}"
    codes = rng.choice(np.arange(10000, 100000), size=K, replace=False)
    out = [str(int(c)) for c in codes]
    if distractors == "near":
        pool = near_codes(out[0])
        if len(pool) < K - 1:
            raise ProbeError(f"near distractors: at most {len(pool)} codes one digit from a code, K = {K}")
        out = [out[0]] + [pool[i] for i in rng.choice(len(pool), size=K - 1, replace=False)]
    return name, out


def draw_decoy_names(rng: np.random.Generator, name: str, n: int) -> list[str]:
    """``n`` distinct names other than ``name``: even ones share its first name, odd ones its last name."""
    first, last = name.split(" ", 1)
    same_first = [f"{first} {x}" for x in LAST if x != last]
    same_last = [f"{x} {last}" for x in FIRST if x != first]
    a = [same_first[i] for i in rng.permutation(len(same_first))]
    b = [same_last[i] for i in rng.permutation(len(same_last))]
    if (n + 1) // 2 > len(a) or n // 2 > len(b):
        raise ProbeError(f"decoys: {n} names requested, at most {2 * min(len(a), len(b))} exist")
    return [(a if i % 2 == 0 else b)[i // 2] for i in range(n)]


def candidate_ids(tokenizer: Any, codes: list[str]) -> list[list[int]]:
    """Token ids of each continuation " <code>" (no special tokens)."""
    return [list(tokenizer(" " + c, add_special_tokens=False)["input_ids"]) for c in codes]


def _insertion_point(text: str, target: int, snap_chars: int) -> tuple[int, bool]:
    """The sentence boundary nearest ``target`` within ``snap_chars`` characters, else the next whitespace."""
    best = None
    lo, hi = max(0, target - snap_chars), min(len(text), target + snap_chars)
    for m in _BOUNDARY.finditer(text, lo, hi):
        if best is None or abs(m.end() - target) < abs(best - target):
            best = m.end()
    if best is not None:
        return best, True
    ws = text.find(" ", target)
    return (ws + 1 if ws >= 0 else len(text)), False


def _with_decoys(doc: str, decoys: list[str], where: np.ndarray, snap_chars: int) -> str:
    """``doc`` with each decoy sentence inserted near relative character position ``where[i]`` (a sentence
    boundary where one is near), the rightmost first so that earlier positions stay valid."""
    spots = sorted(((_insertion_point(doc, int(w * len(doc)), snap_chars)[0], s) for w, s in
                    zip(where, decoys, strict=True)), reverse=True)
    for at, sent in spots:
        head = doc[:at]
        if head and not head[-1].isspace():
            head += " "
        doc = head + sent + doc[at:].lstrip()
    return doc


def build_trial(tokenizer: Any, doc_id: int, text: str, depth: float, window: int, K: int = 10, seed: int = 0,
                rep: int = 0, snap_chars: int = 400, distractors: str = "random", decoys: int = 0,
                stream: int = PROBE_STREAM) -> Trial:
    """A prompt of at most ``window`` tokens (continuations included) with the needle at ``depth`` and
    ``decoys`` other needles (module docstring); ``stream`` separates the RNG of other trial sets (the
    calibration's)."""
    rng = trial_rng(seed, doc_id, depth, rep, stream)
    name, codes = draw_needle(rng, K, distractors)
    if decoys > K - 1:
        raise ProbeError(f"document {doc_id}: {decoys} decoys need at least {decoys + 1} candidates, K = {K}")
    decoy_names = draw_decoy_names(rng, name, decoys) if decoys else []
    decoy_at = rng.random(decoys) if decoys else np.zeros(0)
    decoy_text = [NEEDLE.format(name=n, code=codes[1 + i]) for i, n in enumerate(decoy_names)]
    needle, question = NEEDLE.format(name=name, code=codes[0]), QUESTION.format(name=name)
    max_cont = max(len(c) for c in candidate_ids(tokenizer, codes))
    fixed = len(tokenizer(needle + question, add_special_tokens=True)["input_ids"]) + max_cont
    extra = len(tokenizer("".join(decoy_text), add_special_tokens=False)["input_ids"]) if decoys else 0
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    budget = min(window - fixed - extra - 2, len(offsets))
    if budget < 16:
        raise ProbeError(f"document {doc_id}: window {window} leaves {budget} tokens for the document")
    for _ in range(8):
        doc = text[: offsets[budget - 1][1]]
        doc_offsets, n_doc = offsets, budget
        if decoys:
            doc = _with_decoys(doc, decoy_text, decoy_at, snap_chars)
            doc_offsets = tokenizer(doc, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            n_doc = len(doc_offsets)
        n_total = n_doc + fixed - max_cont
        target_tok = min(max(round(depth * n_total), 0), n_doc - 1)
        at, snapped = _insertion_point(doc, doc_offsets[target_tok][0], snap_chars)
        head = doc[:at]
        if head and not head[-1].isspace():
            head += " "
        prompt = head + needle + doc[at:].lstrip() + question
        penc = tokenizer(prompt, add_special_tokens=True, return_offsets_mapping=True)
        ids = list(penc["input_ids"])
        excess = len(ids) + max_cont - window
        if excess <= 0:
            start = next(i for i, (s, e) in enumerate(penc["offset_mapping"]) if e > len(head) and e > s)
            return Trial(int(doc_id), float(depth), int(rep), name, codes, ids, int(start), snapped,
                         tuple(decoy_names))
        budget -= excess
    raise ProbeError(f"document {doc_id}: could not fit the prompt into {window} tokens")


def score_trial(model: Any, trial: Trial, cands: list[list[int]], device: Any = "cpu",
                on_prompt_done: Callable[[], None] | None = None) -> np.ndarray:
    """Sequence log-probabilities (nats) of the K continuations: one forward of the prompt (KV cache kept,
    logits of its last position only), then one batched forward of the K continuations over that cache.
    ``on_prompt_done`` runs between the two forwards."""
    import torch

    K = len(cands)
    m = max(len(c) for c in cands)
    x = torch.tensor([trial.ids], device=device)
    with torch.inference_mode():
        out = model(input_ids=x, use_cache=True, logits_to_keep=1)
        first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        cache = out.past_key_values
        if on_prompt_done is not None:
            on_prompt_done()
        scores = torch.stack([first[c[0]] for c in cands]).double()
        if m > 1:
            cache.batch_repeat_interleave(K)
            pad = [c + [c[-1]] * (m - len(c)) for c in cands]  # right padding: never seen by real tokens
            cont = torch.tensor(pad, device=device)
            out2 = model(input_ids=cont[:, :-1], past_key_values=cache, use_cache=True)
            lp = torch.log_softmax(out2.logits.float(), dim=-1)  # (K, m-1, V)
            tok = torch.gather(lp, 2, cont[:, 1:, None])[..., 0].double()
            mask = torch.tensor([[j + 1 < len(c) for j in range(m - 1)] for c in cands], device=device)
            scores = scores + (tok * mask).sum(dim=1)
    return scores.cpu().numpy()


def trial_outcome(scores: np.ndarray) -> dict[str, float]:
    """Correct (index 0 ranks first), rank of the correct code (0 = first), margin = correct - best distractor."""
    best_other = float(np.max(scores[1:]))
    return {"correct": bool(scores[0] > best_other), "rank": int(np.sum(scores[1:] >= scores[0])),
            "margin": float(scores[0] - best_other), "logp_correct": float(scores[0])}
