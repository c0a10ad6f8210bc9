"""prepare on thinking-model chat templates that rewrite earlier turns (Qwen3-style, Kimi-K2.5-style), and
on tool-call rows: the loss mask covers exactly the assistant tokens of the rendered conversation.

"Exactly": from the end of the generation prompt through the end-of-turn token, not the header and not
the newline a template writes after the end-of-turn token. The templates are written here, in the style
of the stock ones; the masks are compared with references built another way (a regular expression over
the rendered text; for the append-only template, the old prefix-rendering method).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from pipeline.ondisk import formats
from tests.conftest import run_pipeline

QWEN_STYLE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is defined"
    " and m.reasoning_content is not none else '' %}"
    "{%- set content = m.content %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content }}"
    "{%- if m.tool_calls is defined and m.tool_calls %}{%- for c in m.tool_calls %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + c.function.name + \'", "arguments": \''
    " + (c.function.arguments if c.function.arguments"
    " is string else c.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
KIMI_STYLE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_user|>user<|im_middle|>' + m.content + '<|im_end|>' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_assistant|>assistant<|im_middle|>' }}"
    "{%- if loop.index0 > ns.last_user and m.reasoning_content is defined and m.reasoning_content %}"
    "{{- '<think>' + m.reasoning_content + '</think>' }}{%- else %}{{- '<think></think>' }}{%- endif %}"
    "{{- m.content }}"
    "{%- if m.tool_calls is defined and m.tool_calls %}{{- '<|tool_calls_section_begin|>' }}"
    "{%- for c in m.tool_calls %}"
    "{{- '<|tool_call_begin|>functions.' + c.function.name + ':' + loop.index0|string"
    " + '<|tool_call_argument_begin|>'"
    " + (c.function.arguments if c.function.arguments is string else c.function.arguments|tojson)"
    " + '<|tool_call_end|>' }}"
    "{%- endfor %}{{- '<|tool_calls_section_end|>' }}{%- endif %}"
    "{{- '<|im_end|>' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_system|>tool<|im_middle|>## Return of ' + (m.tool_call_id or '') + '\\n' + m.content"
    " + '<|im_end|>' }}"
    "{%- else %}{{- '<|im_system|>' + m.role + '<|im_middle|>' + m.content + '<|im_end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"
)
TEMPLATES = {
    "qwen3": (QWEN_STYLE, ["<|im_start|>", "<|im_end|>"], r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)"),
    "kimi": (
        KIMI_STYLE,
        [
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
            "<|im_end|>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ],
        r"<\|im_assistant\|>assistant<\|im_middle\|>(.*?<\|im_end\|>)",
    ),
}
CALL = {"id": "c1", "type": "function", "function": {"name": "gpu_memory", "arguments": {"host": "h200"}}}
ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "How much memory?"},
            {"role": "assistant", "content": "About 139 GiB.", "reasoning_content": "H200 has 141 GB."},
            {"role": "user", "content": "Und jetzt?"},
            {"role": "assistant", "content": "Immer noch 139 GiB ✓", "reasoning_content": "Nothing changed."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Check the GPU."},
            {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning_content": "Call the tool."},
            {"role": "tool", "content": '{"free": 12}', "tool_call_id": "c1"},
            {"role": "assistant", "content": "12 GiB free.", "reasoning_content": "The tool said 12."},
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": "<think>polite</think>\n\nYou are welcome."},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "東京の天気は?"},
            {"from": "gpt", "value": "晴れです。"},
            {"from": "human", "value": "明日は?"},
            {"from": "gpt", "value": "雨です。", "reasoning": "Forecast."},
        ]
    },
]


def template_model(directory, tiny_llama, template, specials):
    """A model dir (config.json of the tiny Llama) whose tokenizer has ``specials`` and ``template``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.add_tokens(specials, special_tokens=True)
    tok.chat_template = template
    tok.save_pretrained(directory)
    shutil.copy(tiny_llama / "config.json", directory / "config.json")
    return directory


def reference_mask(text, pattern, offsets):
    """1 on tokens whose first character lies inside a match of ``pattern``'s group 1 in the rendered text."""
    spans = [m.span(1) for m in re.finditer(pattern, text, flags=re.DOTALL)]
    return [int(e > s and any(a <= s < b for a, b in spans)) for s, e in offsets]


def rendered(tok, row):
    from pipeline.prepare import normalize_row

    return tok.apply_chat_template(normalize_row(row), tokenize=False)


@pytest.mark.parametrize("style", list(TEMPLATES))
def test_thinking_templates_mask_exactly_the_rendered_assistant_tokens(style, tmp_path, tiny_llama):
    """Each sample is the whole conversation as the template renders it (earlier reasoning dropped), and its
    mask equals the reference mask built from a regular expression over that text."""
    from transformers import AutoTokenizer

    template, specials, pattern = TEMPLATES[style]
    model = template_model(tmp_path / "m", tiny_llama, template, specials)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS))
    run_pipeline("prepare", "--data", data, "--model", model, "--out", tmp_path / "p", check=True)
    samples, meta = formats.read_prepared(tmp_path / "p")
    tok = AutoTokenizer.from_pretrained(model)
    assert len(samples) == len(ROWS) and meta.mask_method == "chat-template-render-spans"
    for i, row in enumerate(ROWS):
        text = rendered(tok, row)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert samples.ids(i).tolist() == enc["input_ids"]
        assert samples.mask(i).tolist() == reference_mask(text, pattern, enc["offset_mapping"]), (style, i)
    first = tok.decode(samples.ids(0)[samples.mask(0) == 1])
    assert "H200 has 141 GB." not in text and "H200 has 141 GB." not in first  # earlier reasoning: dropped
    assert "Nothing changed." in first and "About 139 GiB." in first  # the last turn keeps it
    tool_row = tok.decode(samples.ids(1)[samples.mask(1) == 1])
    assert (
        "gpu_memory" in tool_row and '"free": 12' not in tool_row
    )  # the call is the assistant's, the result is not


def test_end_of_turn_is_masked_and_the_newline_after_it_is_not(tmp_path, tiny_llama):
    """Per turn, the masked tokens decode to exactly what the assistant generates: the Qwen-style last turn
    is '<think>\\nR\\n</think>\\n\\nC<|im_end|>', an earlier one 'C<|im_end|>'; the '\\n' after is
    unmasked."""
    from transformers import AutoTokenizer

    from pipeline.prepare import TemplateMasker, normalize_row

    template, specials, _ = TEMPLATES["qwen3"]
    tok = AutoTokenizer.from_pretrained(template_model(tmp_path / "m", tiny_llama, template, specials))
    masker = TemplateMasker(tok)
    assert masker.end_of_turn() == "<|im_end|>"
    text, spans = masker.assistant_spans(normalize_row(ROWS[0]))
    assert [text[a:b] for a, b in spans] == [
        "About 139 GiB.<|im_end|>",
        "<think>\nNothing changed.\n</think>\n\nImmer noch 139 GiB ✓<|im_end|>",
    ]
    assert all(text[b] == "\n" for _, b in spans)
    ids, mask = masker(normalize_row(ROWS[0]))
    pieces = [tok.decode([t]) for t, m in zip(ids, mask, strict=True) if m]
    assert pieces.count("<|im_end|>") == 2 and pieces[-1] == "<|im_end|>"
    assert tok.decode(ids[-1:]) == "\n" and mask[-1] == 0 and mask[-2] == 1  # the newline after <|im_end|>


def test_append_only_template_matches_the_prefix_rendering_reference(tiny_llama, conversations):
    """On the stock append-only template the masks equal those of rendering each prefix and diffing the
    character offsets (the method prepare used before)."""
    from transformers import AutoTokenizer

    from pipeline.prepare import TemplateMasker, normalize_row

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    masker = TemplateMasker(tok)
    rows = [json.loads(line) for line in conversations.read_text().splitlines()]
    for row in rows:
        messages = normalize_row(row)
        full = tok.apply_chat_template(messages, tokenize=False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
                spans.append((len(before), len(tok.apply_chat_template(messages[: i + 1], tokenize=False))))
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        want = [int(e > s and any(a <= s < b for a, b in spans)) for s, e in enc["offset_mapping"]]
        assert masker(messages) == (enc["input_ids"], want)


def test_tool_call_rows_on_a_template_that_drops_them_are_refused(tmp_path, tiny_llama):
    """The stock template ignores tool_calls: such a row is refused with one line saying so, exit 2."""
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(ROWS[1]) + "\n")
    proc = run_pipeline("prepare", "--data", data, "--model", tiny_llama, "--out", tmp_path / "p")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert (
        "\n" not in err
        and err.startswith("error: ")
        and "rows.jsonl:1: row has tool_calls, but the chat template "
    )
    assert "does not render them" in err and "--skip-invalid" in err
    assert not (tmp_path / "p").exists()
