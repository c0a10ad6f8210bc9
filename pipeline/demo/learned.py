"""A target that has learned something: a small Llama trained on real offline text, with tokenizer and chat
template.

Owns the recipe of issue #17 item 4, at two sizes:

* the CPU version that ``make demo`` can use instead of the random target (a random target's greedy tokens are
  noise no draft can predict, so its acceptance table means nothing): the Python standard library's own
  sources (``sysconfig``'s stdlib dir, a fixed list of packages), a 4-layer Llama trained for about a minute;
* the GPU version of ``bench/learned_bench.py``: the same stdlib packages plus every ``.py``/``.md``/``.rst``
  file of the installed packages (``corpus="installed"``), a 100-300M Llama trained for a few minutes in bf16
  autocast on packed rows.

Both share:

* conversations made from the corpus: "continue this file" prompts whose answers are the lines that follow;
* a byte-level BPE tokenizer trained on the corpus, with the demo's chat template (pipeline/demo/tiny.py);
* the model saved in bf16 with the tokenizer; ``learned.json`` records the steps, tokens and loss before and
  after;
* ``regenerate``: the target's own greedy answers to the prompts, which is what EAGLE drafts are trained on
  and what the offline acceptance measures against (docs/train.md: offline equals the target's own words
  only then).

Deterministic up to the time budget (the number of steps depends on the machine) and, for ``installed``, up to
the packages installed. It does not run any pipeline stage.
"""

from __future__ import annotations

import bisect
import json
import queue
import random
import shutil
import sysconfig
import threading
import time
from pathlib import Path

from pipeline.ondisk.atomic import atomic_path, write_json

STDLIB_PACKAGES = (
    "json",
    "email",
    "http",
    "logging",
    "urllib",
    "concurrent",
    "importlib",
    "xml",
    "sqlite3",
    "asyncio",
)
INSTALLED_SUFFIXES = (".py", ".md", ".rst")
MAX_FILE_CHARS = (
    400_000  # larger files are generated tables or vendored bundles, not prose or code worth learning
)
SYSTEM = "You are a Python expert. Continue the code exactly as the standard library writes it."
RECORD = "learned.json"
CORPORA = ("stdlib", "installed")


def _skipped(path: Path) -> bool:
    return any(p in ("test", "tests") for p in path.parts)


def corpus_texts(max_chars: int = 600_000, corpus: str = "stdlib") -> list[tuple[str, str]]:
    """(name, text) of corpus files, in a fixed order, up to ``max_chars`` in all.

    ``stdlib``: the ``.py`` files of STDLIB_PACKAGES; ``installed``: those, then every
    ``.py``/``.md``/``.rst`` file under the interpreter's site-packages (sorted paths), test folders and files
    over MAX_FILE_CHARS left out.
    """
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}: choose one of {', '.join(CORPORA)}")
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = [(root, sorted((root / package).rglob("*.py"))) for package in STDLIB_PACKAGES]
    if corpus == "installed":
        seen = set()
        for key in ("purelib", "platlib"):
            site = Path(sysconfig.get_paths()[key])
            if site in seen or not site.is_dir():
                continue
            seen.add(site)
            sources.append((site, sorted(p for p in site.rglob("*") if p.suffix in INSTALLED_SUFFIXES)))
    out, total = [], 0
    for base, paths in sources:
        for path in paths:
            if _skipped(path.relative_to(base)) or not path.is_file():
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            if len(text) > MAX_FILE_CHARS or not text.strip():
                continue
            out.append((str(path.relative_to(base)), text))
            total += len(text)
            if total >= max_chars:
                return out
    return out


class ConversationSampler:
    """Draws "continue this file" conversations, each window position equally likely over the whole corpus."""

    def __init__(
        self,
        texts: list[tuple[str, str]],
        seed: int = 0,
        prompt_lines: int = 6,
        answer_lines: int = 10,
        max_window_chars: int = 3000,
    ):
        self.rng = random.Random(seed)
        self.max_window_chars = max_window_chars  # windows of minified or data lines are drawn again
        self.prompt_lines, self.answer_lines = prompt_lines, answer_lines
        need = prompt_lines + answer_lines
        self.files = [(name, lines) for name, text in texts if len(lines := text.splitlines()) > need]
        if not self.files:
            raise ValueError(f"no corpus file has more than {need} lines")
        self.cumulative, total = [], 0
        for _, lines in self.files:
            total += len(lines) - need
            self.cumulative.append(total)

    def draw(self) -> dict:
        while True:
            at = self.rng.randrange(self.cumulative[-1])
            i = bisect.bisect_right(self.cumulative, at)
            name, lines = self.files[i]
            start = at - (self.cumulative[i - 1] if i else 0)
            cut = start + self.prompt_lines
            shown = "\n".join(lines[start:cut])
            answer = "\n".join(lines[cut : cut + self.answer_lines])
            if answer.strip() and len(shown) + len(answer) <= self.max_window_chars:
                return {
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"Continue {name}:\n{shown}"},
                        {"role": "assistant", "content": answer},
                    ]
                }


QA_SYSTEM = "You are a helpful assistant who explains Python code in plain English."
QA_MIN_CHARS, QA_MAX_CHARS = 80, 1500


def docstring_rows(texts: list[tuple[str, str]]) -> list[dict]:
    """Question-and-answer conversations from the corpus's docstrings (prose, not code): the user asks what a
    module, class or function does, naming its signature; the assistant answers with its docstring. In corpus
    order; files that do not parse are skipped."""
    import ast
    import inspect

    rows = []
    for name, text in texts:
        if not name.endswith(".py"):
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError):
            continue
        module = name[:-3].replace("/", ".").removesuffix(".__init__")
        for node in [tree, *ast.walk(tree)]:
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node, clean=False)
            if not doc:
                continue
            doc = inspect.cleandoc(doc).strip()
            if not QA_MIN_CHARS <= len(doc) <= QA_MAX_CHARS or doc.count(">>>") or doc.count("    ") > 4:
                continue
            if isinstance(node, ast.Module):
                question = f"What is the Python module `{module}` for?"
            elif isinstance(node, ast.ClassDef):
                question = f"What does the class `{node.name}` in `{module}` do?"
            else:
                try:
                    args = ast.unparse(node.args)
                except Exception:  # noqa: BLE001 - an odd signature: ask without it
                    args = "..."
                question = f"What does `{node.name}({args})` in `{module}` do?"
            rows.append(
                {
                    "messages": [
                        {"role": "system", "content": QA_SYSTEM},
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": doc},
                    ]
                }
            )
    return rows


class RowSampler:
    """Draws conversations from a fixed list, uniformly (the docstring Q&A rows' sampler for packed
    training)."""

    def __init__(self, rows: list[dict], seed: int = 0):
        if not rows:
            raise ValueError("no rows to draw from")
        self.rows, self.rng = rows, random.Random(seed)

    def draw(self) -> dict:
        return self.rows[self.rng.randrange(len(self.rows))]


def make_conversations(
    texts: list[tuple[str, str]],
    n: int,
    seed: int = 0,
    prompt_lines: int = 6,
    answer_lines: int = 10,
    weighted: bool = False,
) -> list[dict]:
    """``n`` conversations: the user shows ``prompt_lines`` lines of a file, the assistant writes the next
    ones.

    ``weighted``: every window of the corpus equally likely (ConversationSampler); else a file uniformly first
    (the demo's draw, kept so its data stay the same).
    """
    if weighted:
        sampler = ConversationSampler(texts, seed, prompt_lines, answer_lines)
        return [sampler.draw() for _ in range(n)]
    rng = random.Random(seed)
    rows = []
    files = [
        (name, text.splitlines()) for name, text in texts if text.count("\n") > prompt_lines + answer_lines
    ]
    while len(rows) < n:
        name, lines = files[rng.randrange(len(files))]
        start = rng.randrange(len(lines) - prompt_lines - answer_lines)
        shown = "\n".join(lines[start : start + prompt_lines])
        answer = "\n".join(lines[start + prompt_lines : start + prompt_lines + answer_lines])
        if not answer.strip():
            continue
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Continue {name}:\n{shown}"},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Conversations as JSONL (OpenAI ``messages`` form), written atomically."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(Path(path)) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return Path(path)


def write_conversations(path: Path, n: int = 300, seed: int = 0) -> Path:
    """The demo's conversations for the learned target (JSONL, OpenAI ``messages`` form)."""
    return write_rows(path, make_conversations(corpus_texts(), n, seed + 1000))  # other draws than training's


def _batches(tokenizer, rows: list[dict], seq_length: int, batch: int, rng: random.Random):
    import torch

    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    ids = [x[:seq_length] for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    while True:
        chosen = [ids[rng.randrange(len(ids))] for _ in range(batch)]
        width = max(len(x) for x in chosen)
        tokens = torch.full((batch, width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        for i, x in enumerate(chosen):
            tokens[i, : len(x)] = torch.tensor(x)
            labels[i, : len(x)] = torch.tensor(x)
        yield tokens, labels


def _packed_batches(tokenizer, sampler: ConversationSampler, seq_length: int, batch: int, chunk: int = 1024):
    """Endless [batch, seq_length] rows of chat-templated conversations laid end to end (prefetched in a
    thread)."""
    import torch

    out: queue.Queue = queue.Queue(maxsize=8)
    stop = threading.Event()

    def fill() -> None:
        stream: list[int] = []
        need = batch * seq_length
        while not stop.is_set():
            texts = [
                tokenizer.apply_chat_template(sampler.draw()["messages"], tokenize=False)
                for _ in range(chunk)
            ]
            for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
                stream.extend(ids)
            while len(stream) >= need and not stop.is_set():
                rows = torch.tensor(stream[:need], dtype=torch.long).view(batch, seq_length)
                del stream[:need]
                out.put(rows)

    thread = threading.Thread(target=fill, daemon=True, name="learned-batches")
    thread.start()
    try:
        while True:
            rows = out.get()
            yield rows, rows
    finally:
        stop.set()


def _lr_at(step_frac: float, warmup: float) -> float:
    """Warm-up then cosine to 10%, as a factor of the peak, over the time budget's fraction ``step_frac``."""
    import math

    if step_frac < warmup:
        return max(step_frac / warmup, 0.01)
    x = min(1.0, (step_frac - warmup) / max(1e-9, 1.0 - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * x))


def build_learned_model(
    out_dir: Path,
    *,
    seconds: float = 60.0,
    seed: int = 0,
    conversations: int = 2000,
    seq_length: int = 256,
    batch: int = 8,
    lr: float = 3e-3,
    corpus: str = "stdlib",
    max_chars: int = 600_000,
    tokenizer_chars: int | None = None,
    vocab_size: int | None = None,
    device: str = "cpu",
    packed: bool = False,
    prompt_lines: int = 6,
    answer_lines: int = 10,
    texts: list[tuple[str, str]] | None = None,
    sampler=None,
    log=None,
    **overrides,
) -> Path:
    """Train and save the learned Llama (with tokenizer, chat template and ``learned.json``) into ``out_dir``.

    The demo's call (the defaults) trains in fp32 on ``conversations`` padded rows at a constant ``lr``.
    ``packed=True`` (the benchmark) draws conversations without end (ConversationSampler), packs them into
    [batch, seq_length] rows, and follows a warm-up + cosine schedule over the ``seconds`` budget; on a GPU
    it runs in bf16 autocast with fused AdamW. ``texts``: the corpus already read (else ``corpus_texts``).
    ``sampler`` (packed only): what draws the conversations instead (e.g. RowSampler of docstring_rows).
    ``overrides`` go to the LlamaConfig (pipeline/demo/tiny.py's defaults).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.demo.tiny import VOCAB_SIZE, llama_config, train_tokenizer

    say = log or (lambda m: None)
    out_dir = Path(out_dir)
    staging = out_dir.with_name(out_dir.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    t0 = time.monotonic()
    texts = texts if texts is not None else corpus_texts(max_chars, corpus)
    chars = sum(len(t) for _, t in texts)
    say(f"corpus: {len(texts)} files, {chars / 1e6:.1f} M chars ({time.monotonic() - t0:.1f} s)")
    sample = [t for _, t in texts]
    if tokenizer_chars:  # a fixed-seed share of the files, enough for the merges
        random.Random(seed).shuffle(sample)
        total, cut = 0, 0
        while cut < len(sample) and total < tokenizer_chars:
            total += len(sample[cut])
            cut += 1
        sample = sample[:cut]
    tokenizer = train_tokenizer(staging, seed=seed, texts=sample, vocab_size=vocab_size or VOCAB_SIZE)
    say(f"tokenizer: {len(tokenizer)} tokens ({time.monotonic() - t0:.1f} s)")
    config = llama_config(len(tokenizer), **{"num_hidden_layers": 4, "dtype": "float32", **overrides})
    dev = torch.device(device)
    torch.manual_seed(seed)
    with dev:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    say(f"model: {params / 1e6:.1f} M parameters on {dev}")
    if packed:
        sampler = sampler or ConversationSampler(texts, seed, prompt_lines, answer_lines)
        data = _packed_batches(tokenizer, sampler, seq_length, batch)
        opt = torch.optim.AdamW(
            model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95), fused=dev.type == "cuda"
        )
    else:
        rows = make_conversations(texts, conversations, seed, prompt_lines, answer_lines)
        data = _batches(tokenizer, rows, seq_length, batch, random.Random(seed))
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    losses, tokens_seen, start, next_log = [], 0, time.monotonic(), 0.0
    model.train()
    while time.monotonic() - start < seconds or not losses:
        tokens, labels = next(data)
        if packed:
            for group in opt.param_groups:
                group["lr"] = lr * _lr_at((time.monotonic() - start) / seconds, 0.05)
        tokens, labels = tokens.to(dev, non_blocking=True), labels.to(dev, non_blocking=True)
        with autocast:
            loss = model(input_ids=tokens, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = loss.detach()
        losses.append(loss)
        tokens_seen += tokens.numel()
        if time.monotonic() - start >= next_log:
            say(
                f"  step {len(losses)}: loss {loss.item():.3f}, "
                f"{tokens_seen / (time.monotonic() - start):,.0f} tok/s"
            )
            next_log += max(5.0, seconds / 10)
    losses = [float(x) for x in losses]
    seconds_run = time.monotonic() - start
    model.to(torch.bfloat16).save_pretrained(staging, safe_serialization=True)
    head = min(10, len(losses))
    write_json(
        staging / RECORD,
        {
            "steps": len(losses),
            "seconds": round(seconds_run, 1),
            "tokens": tokens_seen,
            "tokens_per_s": round(tokens_seen / seconds_run, 1),
            "parameters": params,
            "loss_first": sum(losses[:head]) / head,
            "loss_last": sum(losses[-head:]) / head,
            "corpus": corpus,
            "corpus_files": len(texts),
            "corpus_chars": chars,
            "packages": list(STDLIB_PACKAGES),
            "device": str(dev),
            "packed": packed,
            "seq_length": seq_length,
            "batch": batch,
            "lr": lr,
        },
    )
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


def regenerate(
    model_dir: Path,
    rows: list[dict],
    *,
    max_new_tokens: int = 256,
    batch: int = 128,
    device: str = "cpu",
    batch_tokens: int = 131072,
) -> tuple[list[dict], dict]:
    """``rows`` with each last assistant turn replaced by the target's own greedy answer to what precedes it.

    Prompts go shortest first, at most ``batch`` a batch and ``batch_tokens`` padded prompt + new tokens.

    Returns the new rows and figures: answers that ended with the end-of-turn token, mean new tokens, seconds.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    dev = torch.device(device)
    model = (
        AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32
        )
        .to(dev)
        .eval()
    )
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    out, ended, new_tokens = [], 0, 0
    prompts = [
        tok.apply_chat_template(r["messages"][:-1], tokenize=False, add_generation_prompt=True) for r in rows
    ]
    lengths = [len(x) for x in tok(prompts, add_special_tokens=False)["input_ids"]]
    order = sorted(range(len(rows)), key=lambda i: lengths[i])  # similar lengths share a batch
    batches, current = [], []
    for i in order:
        if current and (
            len(current) >= batch or (len(current) + 1) * (lengths[i] + max_new_tokens) > batch_tokens
        ):
            batches.append(current)
            current = []
        current.append(i)
    batches.append(current)
    answers: dict[int, str] = {}
    for idx in batches:
        enc = tok([prompts[i] for i in idx], add_special_tokens=False, return_tensors="pt", padding=True).to(
            dev
        )
        with torch.no_grad():
            gen = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eot,
                pad_token_id=tok.pad_token_id,
            )
        for i, seq in zip(idx, gen[:, enc["input_ids"].shape[1] :].tolist()):
            if eot in seq:
                seq = seq[: seq.index(eot)]
                ended += 1
            new_tokens += len(seq)
            answers[i] = tok.decode(seq, skip_special_tokens=True)
    del model
    for i, row in enumerate(rows):
        messages = [dict(m) for m in row["messages"]]
        messages[-1]["content"] = answers[i] if answers[i].strip() else row["messages"][-1]["content"]
        out.append({"messages": messages})
    return out, {
        "rows": len(rows),
        "ended_with_eot": ended / max(1, len(rows)),
        "mean_new_tokens": new_tokens / max(1, len(rows)),
        "generate_seconds": round(time.monotonic() - t0, 1),
        "empty_kept_original": sum(1 for i in range(len(rows)) if not answers[i].strip()),
        "batches": len(batches),
        "max_prompt_tokens": max(lengths),
    }
