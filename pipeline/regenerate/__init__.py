"""The ``regenerate`` stage: conversations in, the same conversations out with their assistant turns
rewritten by the target itself, through an OpenAI-compatible chat endpoint (the host's running vLLM server, or
a ``vllm serve`` this stage starts on its own GPUs where none runs).

EAGLE-3 drafts learn to predict the target's next tokens; trained on someone else's answers (or on answers
without the target's reasoning blocks) they learn words the target would not have written, which caps their
acceptance. ``regenerate`` makes the answers the target's own, and its output is what ``prepare`` reads.

Modules: ``config.py`` (the options), ``rows.py`` (the input rows and the requests each one asks for: pure),
``replies.py`` (what a server's answer is: a whole answer, or a rejected row and why: pure), ``endpoint.py``
(the HTTP client, the server checks before any row, the local server), ``journal.py`` (the resumable record of
finished rows and the final files), ``stage.py`` (the run), ``cli.py`` (the command).
"""
