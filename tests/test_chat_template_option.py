"""A chat template of the server's own (--chat-template) or the caller's (LLM.chat's chat_template), used instead of the
model's; a bad one stops the start with its reason."""

import pytest
from test_cli import run_cli

from pagedserve import SamplingParams

TEMPLATE = ("{% for message in messages %}[{{ message.role }}] {{ message.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
RENDERED = "[system] Be brief.\n[user] Name a colour.\n[assistant] "


def test_llm_chat_renders_with_the_template_given(default_llm, tokenizer):
    output = default_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False, chat_template=TEMPLATE)[0]
    assert output.prompt_token_ids == tokenizer(RENDERED, add_special_tokens=False).input_ids


@pytest.mark.slow
def test_the_server_renders_every_chat_with_its_template_from_a_file(tiny_models, tmp_path, tokenizer):
    from server_utils import RemoteServer

    (tmp_path / "template.jinja").write_text(TEMPLATE)
    server = RemoteServer("--model", str(tiny_models["llama"]), "--served-model-name", "tiny", "--kv-cache-memory", str(16 * 1024**2),
                          "--chat-template", str(tmp_path / "template.jinja"))
    try:
        expected = tokenizer(RENDERED, add_special_tokens=False).input_ids
        assert server.post("/tokenize", json={"model": "tiny", "messages": MESSAGES}).json()["tokens"] == expected
        completion = server.openai().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        assert completion.usage.prompt_tokens == len(expected)
    finally:
        assert server.stop() == 0, server.log_text()[-3000:]


@pytest.mark.parametrize("value, reason", [("/no/such/template.jinja", "neither a template nor a file that can be read"),
                                           ("{% if %}", "the template does not parse")])
def test_a_template_that_cannot_be_used_stops_the_start_with_its_reason(value, reason):
    result = run_cli("serve", "--chat-template", value)
    assert result.returncode != 0 and "--chat-template" in result.stderr and reason in result.stderr
