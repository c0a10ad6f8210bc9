"""``pipeline regenerate``: the run, from the conversations file to the answered rows.

Reads and checks every input row first, then the output directory (a killed run's journal is continued),
then the server (``endpoint.Endpoint.check``: up, our model, a chat template), and only then asks: each
pending row goes to a pool of ``concurrency`` threads, each row's turns in order (rows.regenerate_row), every
finished row (kept or rejected) appended to the journal by this thread as it lands. A progress line every
``progress_every`` seconds (rows, rejected, output tokens/s). A server that stops answering stops the run
(``EndpointDown``, exit 4) with the finished rows kept; Ctrl-C likewise. At the end the final files and the
summary, and exit 3 when more than ``max_rejected`` of the rows were rejected.
"""

from __future__ import annotations

import contextlib
import sys
import time
import zlib
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from pipeline.errors import CheckFailed, StageError
from pipeline.ondisk import provenance
from pipeline.ondisk.outdir import output_lock, refuse_overlap
from pipeline.regenerate import endpoint as ep
from pipeline.regenerate.config import RegenerateConfig
from pipeline.ondisk.formats import file_digest
from pipeline.regenerate.journal import REQUEST, Journal, refuse
from pipeline.regenerate.replies import REASONS
from pipeline.regenerate.rows import Row, read_conversations, regenerate_row


def row_seed(seed: int, row_id: str) -> int:
    """A row's sampling seed: stable across runs, different per row."""
    return (seed + zlib.crc32(row_id.encode("utf-8"))) % (2**31)


class Progress:
    """The progress line on stderr, at most every ``every`` seconds."""

    def __init__(self, total: int, done: int, every: float):
        self.total, self.done, self.every = total, done, every
        self.start = self.last = time.monotonic()
        self.tokens = self.rejected = 0

    def add(self, tokens: int, rejected: bool) -> None:
        self.done += 1
        self.tokens += tokens
        self.rejected += rejected
        now = time.monotonic()
        if now - self.last >= self.every or self.done == self.total:
            self.last = now
            rate = self.tokens / max(now - self.start, 1e-9)
            print(
                f"regenerate: {self.done}/{self.total} rows, {self.rejected} rejected, "
                f"{rate:,.0f} output tok/s",
                file=sys.stderr,
                flush=True,
            )


def _request(cfg: RegenerateConfig, model: str) -> dict:
    return {
        "data_sha256": file_digest(cfg.data).sha256,
        "served_model": model,
        "turns": cfg.turns,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "seed": cfg.seed,
        "chat_template_kwargs": cfg.template_kwargs(),
        "sampling": cfg.extra_sampling(),
    }


def _ask_rows(
    cfg: RegenerateConfig, client: ep.Endpoint, pending: list[Row], journal: Journal, progress: Progress
) -> tuple[int, int]:
    """Ask every pending row, ``concurrency`` at once; every result into the journal as it lands. Returns
    (completion tokens, prompt tokens) spent in this run, summed here on the calling thread."""
    spent = [0, 0]

    def one(row: Row):
        sampling = {
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "seed": row_seed(cfg.seed, row.id),
            "template_kwargs": cfg.template_kwargs(),
            **cfg.extra_sampling(),
        }

        prompt_tokens = [0]  # this row's own: one thread asks a row's turns, one after another

        def ask(messages):
            reply = client.chat(messages, **sampling)
            prompt_tokens[0] += getattr(reply, "prompt_tokens", 0)
            return reply

        return *regenerate_row(row, cfg.turns, ask), prompt_tokens[0]

    rows = iter(pending)
    with ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="regenerate") as pool:
        running: dict[Future, Row] = {}
        try:
            for row in rows:
                running[pool.submit(one, row)] = row
                if len(running) >= cfg.concurrency:
                    break
            while running:
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    row = running.pop(fut)
                    answered, rejected, tokens, prompt_tokens = fut.result()  # EndpointDown ends the run
                    spent[0] += tokens
                    spent[1] += prompt_tokens
                    if answered is not None:
                        journal.add(row.id, row=answered)
                    else:
                        journal.add(
                            row.id,
                            rejected={"reason": rejected.reason, "detail": rejected.detail, "line": row.line},
                        )
                    progress.add(tokens, answered is None)
                    nxt = next(rows, None)
                    if nxt is not None:
                        running[pool.submit(one, nxt)] = nxt
        except BaseException:
            for fut in running:
                fut.cancel()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return spent[0], spent[1]


def _served(cfg: RegenerateConfig, out: Path):
    """The endpoint's URL: --endpoint, or a local server started for this run (a context either way)."""
    if cfg.endpoint is not None:
        return contextlib.nullcontext(cfg.endpoint)
    from pipeline.model.modeldir import read_model_dir

    read_model_dir(cfg.model)  # a missing or broken folder in one line, before a server starts on it
    port = ep.free_port()
    argv = ep.serve_argv(
        cfg.model,
        port,
        tensor_parallel_size=cfg.tensor_parallel_size,
        max_model_len=cfg.max_model_len,
        dtype=cfg.dtype,
    )
    print(
        f"regenerate: starting a local vllm serve of {cfg.model} (log: {out / 'server.log'})",
        file=sys.stderr,
        flush=True,
    )
    return ep.local_server(argv, port, out / "server.log", start_timeout=cfg.server_start_timeout)


def check(cfg: RegenerateConfig, say=print) -> None:
    """``--check``: what a run checks before its first row, in its order but writing nothing and asking no
    row: the input rows, the server (``Endpoint.check``: it answers, serves our model, renders a chat; with
    no --endpoint only the model folder, no local server is started), then the output directory's policy
    against the request the run would record. One line per check (``ok NAME: ...``, or ``FAIL NAME: ...``
    and the refusal raised, so the exit code is the run's own)."""
    name = "input"
    try:
        refuse_overlap(cfg.out, {"--data": cfg.data} | ({"--model": cfg.model} if cfg.model else {}))
        rows, skipped = read_conversations(cfg.data, skip_invalid=cfg.skip_invalid)
        say(f"ok   input: {len(rows)} rows in {cfg.data}" + (f", {len(skipped)} skipped" if skipped else ""))
        name = "server"
        if cfg.endpoint is None:
            from pipeline.model.modeldir import read_model_dir

            read_model_dir(cfg.model)
            model = cfg.served_model or ep.SERVED_NAME
            say(f"ok   server: no --endpoint; the run starts a local vllm serve of {cfg.model} (not now)")
        else:
            client = ep.Endpoint(cfg.endpoint, cfg.served_model, timeout=cfg.request_timeout, retries=0)
            try:
                model = client.check(cfg.template_kwargs())
            finally:
                client.close()
            say(f"ok   server: {client.url} serves {model!r} and renders its chat")
        name = "output"
        refuse(cfg.out, _request(cfg, model), overwrite=cfg.overwrite)
        if (cfg.out / REQUEST).exists():
            state = "replaced (--overwrite)" if cfg.overwrite else "a killed run's, continued"
        else:
            state = "new"
        say(f"ok   output: {cfg.out} {state}")
    except StageError as exc:
        say(f"FAIL {name}: {exc}")
        raise


def run(cfg: RegenerateConfig) -> dict:
    """Regenerate ``cfg.data`` into ``cfg.out``; the summary."""
    started = time.monotonic()
    inputs = {"--data": cfg.data} | ({"--model": cfg.model} if cfg.model else {})
    refuse_overlap(cfg.out, inputs)
    rows, skipped = read_conversations(cfg.data, skip_invalid=cfg.skip_invalid)
    with output_lock(cfg.out), _served(cfg, cfg.out) as url:
        served_model = cfg.served_model if cfg.endpoint is not None else ep.SERVED_NAME
        client = ep.Endpoint(
            url, served_model, timeout=cfg.request_timeout, retries=cfg.retries, concurrency=cfg.concurrency
        )
        try:
            model = client.check(cfg.template_kwargs())
            journal = Journal(cfg.out, _request(cfg, model), overwrite=cfg.overwrite)
            try:
                pending = [r for r in rows if r.id not in journal.done]
                resumed = len(rows) - len(pending)
                if resumed:
                    print(
                        f"regenerate: continuing {cfg.out}: {resumed} of {len(rows)} rows already done",
                        file=sys.stderr,
                        flush=True,
                    )
                progress = Progress(len(rows), resumed, cfg.progress_every)
                loop_start = time.monotonic()
                completion, prompt = _ask_rows(cfg, client, pending, journal, progress)
                loop_s = time.monotonic() - loop_start
                reasons = Counter(e["rejected"]["reason"] for e in journal.done.values() if "rejected" in e)
                kept = len(rows) - sum(reasons.values())
                summary = provenance.stamp(
                    {
                        "stage": "regenerate",
                        "data": str(cfg.data.resolve()),
                        "endpoint": url if cfg.endpoint is not None else "local vllm serve",
                        "served_model": model,
                        "turns": cfg.turns,
                        "rows": len(rows),
                        "kept": kept,
                        "rejected": sum(reasons.values()),
                        "rejected_by_reason": {r: reasons.get(r, 0) for r in REASONS},
                        "skipped_invalid_lines": skipped,
                        "resumed_rows": resumed,
                        "asked_rows": len(pending),
                        "completion_tokens": completion,
                        "prompt_tokens": prompt,
                        "loop_s": round(loop_s, 3),
                        "output_tokens_per_s": round(completion / loop_s, 1) if loop_s > 0 else None,
                        "wall_s": round(time.monotonic() - started, 3),
                    },
                    "regenerate",
                )
                journal.finish([r.id for r in rows], summary)
            finally:
                journal.close()
        finally:
            client.close()
    share = summary["rejected"] / len(rows)
    if share > cfg.max_rejected:
        top = max(reasons, key=reasons.get)
        raise CheckFailed(
            f"{summary['rejected']} of {len(rows)} rows rejected ({share:.0%} > --max-rejected "
            f"{cfg.max_rejected:.0%}; most: {reasons[top]} {top}, {REASONS[top]}): "
            f"see {cfg.out}/rejected.jsonl"
        )
    return summary


__all__ = ["check", "run", "row_seed"]
