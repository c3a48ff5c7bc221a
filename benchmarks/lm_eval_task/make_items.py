"""Write next_word.jsonl: 20 sentences of the shipped model's held-out text, each with its last word
and three distractors (the last words of other items) as a 4-way choice.

Run from the repository root: ``python -m benchmarks.lm_eval_task.make_items``. Deterministic.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
HELDOUT = HERE.parents[1] / "afd_engine" / "assets" / "tiny-deepseek-v3-pydoc" / "heldout.txt"
ITEMS, CHOICES, SEED = 20, 4, 0


def sentences(text: str) -> list[tuple[str, str]]:
    """(sentence without its last word, last word) of prose sentences of 8-30 words, each once
    (two held-out topics share paragraphs)."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        if para.startswith(" ") or "*" in para or "::=" in para:  # code, headings, grammar
            continue
        for s in re.split(r"(?<=\.)\s+", " ".join(para.split())):
            m = re.fullmatch(r"([A-Z][^\"*()]+) ([a-z]{4,})\.", s)
            if m and 8 <= len(s.split()) <= 30 and (m.group(1), m.group(2)) not in out:
                out.append((m.group(1), m.group(2)))
    return out


def main() -> None:
    pool = sentences(HELDOUT.read_text(encoding="utf-8"))
    picked = [pool[i * len(pool) // ITEMS] for i in range(ITEMS)]  # spread over the whole text
    words = sorted({w for _, w in picked})
    rng = random.Random(SEED)
    with open(HERE / "next_word.jsonl", "w", encoding="utf-8") as f:
        for context, word in picked:
            choices = [word, *rng.sample([w for w in words if w != word], CHOICES - 1)]
            rng.shuffle(choices)
            f.write(json.dumps({"context": context, "choices": choices, "label": choices.index(word)}) + "\n")
    print(f"{len(pool)} candidate sentences, wrote {ITEMS} items")


if __name__ == "__main__":
    main()
