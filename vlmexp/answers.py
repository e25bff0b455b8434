"""Reading the answer out of a completion and matching it to a ground truth: one function per answer method.

The methods are VLM-R1's `accu_reward_method` values for text answers (om-ai-lab/VLM-R1,
src/open-r1-multimodal/src/open_r1/grpo_jsonl.py: `default_accuracy_reward`, `mcq_reward`, `yes_no_reward`,
`all_match_reward`, `numeric_reward`, `clean_text`, `extract_choice`): "default" scores as VLM-R1's
`default_accuracy_reward` (`vlm_r1_default`, partial credit by Levenshtein ratio), or as vlmexp's exact match
(`exact_match`) with the exact reward's `default_match: exact`. Box answers live in vlmexp.detection, the math
graders in `grade_math`.

Completions of a model whose chat template pre-fills `<think>` begin inside the think block
("reasoning...</think>answer"): where VLM-R1 falls back to the whole completion when it finds no
<answer> tag, we fall back to the text after the last `</think>`, so reasoning is never read as the answer.
"""

from __future__ import annotations

import re
import string

THINK_END = "</think>"
CHOICE_METHODS = ("mcq", "yes_no")  # methods that extract a choice from the answer before comparing
ANSWER_METHODS = ("default", "mcq", "yes_no", "all_match")  # the methods of task "exact"
MATH_GRADERS = ("math_verify", "mathruler")
MATHRULER_HINT = "pip install 'vlmexp[mathruler]' (mathruler and pylatexenc)"


def extract_answer(text: str, tag: str = "answer") -> str | None:
    """Content of the last <tag>...</tag>, else of the last \\boxed{...}; None if neither is present."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    if found:
        return found[-1].strip()
    boxed = last_boxed(text)
    return boxed.strip() if boxed is not None else None


def last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def after_think(text: str) -> str:
    """The text after the last </think> (the answer part of a thinking completion), else the whole text."""
    return text.rpartition(THINK_END)[2] if THINK_END in text else text


def answer_text(text: str, tag: str = "answer", last: bool = True, dotall: bool = True) -> str:
    """VLM-R1's answer reading: the first or last <tag> content, else the whole text (after the last
    </think>)."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL if dotall else 0)
    if found:
        return (found[-1] if last else found[0]).strip()
    return after_think(text).strip()


def clean_text(text: str, tag: str = "answer") -> str:
    """VLM-R1's `clean_text`: the last <answer> content (else the text), newlines to spaces, stripped, a final
    '.' removed, lower case."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    text = found[-1] if found else after_think(text)
    for char in ("\n", "\r"):
        text = re.sub(r"(?<=\s)" + re.escape(char), "", text)
        text = re.sub(r"(?<!\s)" + re.escape(char), " ", text)
    return text.strip().rstrip(".").lower()


_KEYWORDS = ("答案", "选择", "正确", "是", "对", "answer", "correct", "choose", "select", "right",
             "认为", "应该", "觉得", "think", "believe", "should")


def extract_choice(text: str) -> str | None:
    """The option letter a text names (VLM-R1's `extract_choice`, with its keyword and position heuristic when
    several letters qualify). One change: VLM-R1 accepts a letter only before . , ? ! : ; or the end, so
    "The answer is (B)." names no choice there; here a closing ')' or ']' qualifies too."""
    text = re.sub(r"\s+", " ", text.upper())
    choices = re.findall(r"(?<![A-Z])([A-Z])(?=[\.\,\?\!\:\;\)\]]|$)", text)
    if not choices:
        return None
    if len(choices) == 1:
        return choices[0]
    scores = dict.fromkeys(choices, 0)
    for choice in choices:
        pos = text.find(choice)
        context = text[max(0, pos - 20):min(len(text), pos + 20)]
        scores[choice] += sum(keyword.upper() in context for keyword in _KEYWORDS)
        if pos > len(text) * 0.7:  # near the end: usually the final answer
            scores[choice] += 2
        if pos < len(text) - 1 and text[pos + 1] in "。.!！,，":
            scores[choice] += 1
    return max(scores.items(), key=lambda item: item[1])[0]


def extract_yes_no(text: str) -> str | None:
    """The first whole word yes or no (VLM-R1's `yes_no_reward` searches `(yes|no)` inside words too, so
    "I don't know" reads as "no" there; here only whole words count)."""
    found = re.search(r"\b(yes|no)\b", text.lower())
    return found.group(1) if found else None


def gold_answer(solution: str, tag: str = "answer") -> str:
    """The ground truth of a solution: its first <tag> content (one line, as VLM-R1 reads it), else the
    solution."""
    found = re.search(rf"<{tag}>(.*?)</{tag}>", solution)
    return found.group(1).strip() if found else solution.strip()


def gold_choice(method: str, solution: str) -> str | None:
    """The choice a solution names for an mcq / yes_no record; None when it names none (a bad record)."""
    gold = gold_answer(solution)
    return extract_choice(gold) if method == "mcq" else extract_yes_no(gold)


def normalise(text: str) -> str:
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(text.split())


_CHOICE = re.compile(r"^\(?([A-Za-z])[\).:]?(?:\s|$)")


def exact_match(answer: str, gold: str) -> bool:
    """vlmexp's "default": equal after normalising case, spaces and punctuation, or the same choice letter
    ("B", "(B)", "B. a cat")."""
    if normalise(answer) == normalise(gold):
        return True
    a, g = _CHOICE.match(answer.strip()), _CHOICE.match(gold.strip())
    return bool(a and g and a.group(1).upper() == g.group(1).upper())


def levenshtein_ratio(a: str, b: str) -> float:
    """python-Levenshtein's `ratio` (what VLM-R1 imports as `from Levenshtein import ratio`): 1 - the
    insertions and deletions that turn `a` into `b`, over len(a) + len(b); that is 2 x the longest common
    subsequence / (len(a) + len(b)), 1.0 for two empty strings. The subsequence is counted bit-parallel
    (Hyyro's algorithm, as rapidfuzz's `LCSseq` does), one big-integer step per character of `b`."""
    total = len(a) + len(b)
    if not total:
        return 1.0
    matches: dict[str, int] = {}
    for i, char in enumerate(a):
        matches[char] = matches.get(char, 0) | 1 << i
    mask = (1 << len(a)) - 1
    row = mask
    for char in b:
        common = row & matches.get(char, 0)
        row = ((row + common) | (row - common)) & mask
    lcs = len(a) - bin(row).count("1")
    return 2 * lcs / total


def _number(text: str) -> float | None:
    """VLM-R1's `numeric_reward` reading: the cleaned text as a float, else None."""
    try:
        return float(clean_text(text))
    except ValueError:
        return None


def vlm_r1_default(text: str, solution: str, tag: str = "answer") -> float | None:
    """VLM-R1's `default_accuracy_reward` (grpo_jsonl.py): the last <answer> (else the whole completion)
    against the solution's first one. 1.0 when math-verify finds them equal; else, when the solution holds a
    digit, 1.0 / 0.0 for two numbers (`numeric_reward`) and the Levenshtein ratio of the cleaned texts
    otherwise; when it names an option letter, 1.0 / 0.0 for the letter the answer names (None when it names
    none: unparsable, scored 0 as VLM-R1 does, and counted); else the Levenshtein ratio of the cleaned texts
    (partial credit)."""
    from math_verify import parse, verify

    gold, answer = gold_answer(solution, tag), answer_text(text, tag)
    parsed = parse(answer)
    if parsed and float(verify(parsed, parse(gold))) > 0:  # VLM-R1's argument order
        return 1.0
    if re.search(r"\d", gold):
        said, want = _number(answer), _number(gold)
        if said is not None and want is not None:
            return float(said == want)
        return levenshtein_ratio(clean_text(answer), clean_text(gold))
    if (choice := extract_choice(gold)) is not None:
        said = extract_choice(answer)
        return None if said is None else float(said == choice)
    return levenshtein_ratio(clean_text(answer), clean_text(gold))


def check_math_grader(grader: str) -> None:
    """Raise ValueError unless `grader` is known and importable (mathruler is an optional extra)."""
    import importlib.util

    if grader not in MATH_GRADERS:
        raise ValueError(f"grader {grader!r} is not one of {', '.join(MATH_GRADERS)}")
    if grader == "mathruler":
        missing = [m for m in ("mathruler", "pylatexenc") if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(f"grader 'mathruler' needs {' and '.join(missing)}, not installed here: "
                             f"{MATHRULER_HINT}, or use grader: math_verify")


def grade_math(answer: str, gold: str, grader: str) -> bool | None:
    """Whether `answer` equals `gold`; None when the grader cannot read the answer.

    math_verify: vlmexp's default (answers wrapped in $...$ when bare). mathruler: as EasyR1 grades math
    (hiyouga/EasyR1, examples/reward_function/math.py: `grade_answer(extract_boxed_content(response),
    ground_truth)`), with the content of a \\boxed{} in the answer taken first.
    """
    if grader == "mathruler":
        from mathruler.grader import extract_boxed_content, grade_answer

        if "\\boxed{" in answer:
            answer = extract_boxed_content(answer)
        return bool(grade_answer(answer, gold))
    from math_verify import parse, verify

    parsed_gold = parse(_as_math(gold))
    if not parsed_gold:
        raise ValueError(f"math-verify cannot parse the solution {gold!r}; fix the record's answer")
    pred = parse(_as_math(answer))
    return bool(verify(parsed_gold, pred)) if pred else None


def _as_math(text: str) -> str:
    """math-verify reads LaTeX inside $...$ or \\boxed{}; wrap a bare answer so it is found."""
    return text if any(m in text for m in ("$", "\\boxed", "\\(", "\\[")) else f"${text}$"
