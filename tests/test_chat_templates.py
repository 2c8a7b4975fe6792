"""Chat templates that rewrite earlier turns (Qwen3, GPT-OSS), --chat-template, prompt/completion
records, tools, --model bytes and datasets loaded through datasets.load_dataset (CPU, seconds).

The templates are tests/chat_templates/*.jinja, written out from the public Qwen3 and GPT-OSS
templates (nothing is downloaded); the tokenizer is a byte-level BPE trained here with both
families' control tokens. Each mask is checked token by token against the rendered text, whose
assistant turns are found by a rule written from the template format, independently of oomb."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from oomb.cli import main
from oomb.train.chat import ChatFormat, ChatRenderer, check_messages, check_tools
from oomb.data.codec import TokenizerCodec
from oomb.data.documents import sibling
from oomb.train.sources import Hub, tokenize
from test_data_sources import read, write_jsonl

TEMPLATES = Path(__file__).parent / "chat_templates"
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
           "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
WORDS = "the cat sat on a mat weather in Paris is sunny why because hello how are you city".split()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "required": ["city"], "properties": {
                                               "city": {"type": "string", "description": "its name"}}}}}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A byte-level BPE with both families' control tokens as single tokens; no chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=CONTROL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([" ".join(WORDS)] * 20 + ["user\nassistant\nsystem analysis final get_weather"] * 20,
                             trainer)
    path = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>").save_pretrained(path)
    return str(path)


def tokenizer(path, template_name=None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if template_name:
        tok.chat_template = (TEMPLATES / template_name).read_text()
    return tok


def words(rng, low=1, high=6):
    return " ".join(rng.choice(WORDS, int(rng.integers(low, high))))


def qwen3_chat(rng):
    """System, rounds of a user query, maybe a tool call and its answer, and a reply; reasoning
    as reasoning_content or inline <think>, on some turns."""
    messages = [{"role": "system", "content": words(rng)}] if rng.random() < 0.5 else []
    for _ in range(int(rng.integers(1, 4))):
        messages.append({"role": "user", "content": words(rng) + "?"})
        if rng.random() < 0.4:
            messages.append({"role": "assistant", "content": words(rng) if rng.random() < 0.5 else "",
                             "tool_calls": [{"type": "function", "function": {
                                 "name": "get_weather", "arguments": {"city": str(rng.choice(WORDS))}}}]})
            messages.append({"role": "tool", "content": words(rng)})
        reply = {"role": "assistant", "content": words(rng)}
        if rng.random() < 0.4:
            reply["reasoning_content"] = words(rng)
        elif rng.random() < 0.5:
            reply["content"] = f"<think>\n{words(rng)}\n</think>\n\n{reply['content']}"
        messages.append(reply)
    return messages


def qwen3_turns(text):
    """Each assistant turn: after its '<|im_start|>assistant\\n' header, through its <|im_end|>."""
    return [(m.end(), text.index("<|im_end|>", m.end()) + len("<|im_end|>"))
            for m in re.finditer(re.escape("<|im_start|>assistant\n"), text)]


def gpt_oss_chat(rng):
    """Developer message, rounds of a user query, maybe a tool call (with thinking or an analysis
    in content) and its answer, and a final reply with or without thinking."""
    messages = [{"role": "system", "content": words(rng)}] if rng.random() < 0.5 else []
    for _ in range(int(rng.integers(1, 4))):
        messages.append({"role": "user", "content": words(rng) + "?"})
        if rng.random() < 0.4:
            call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": str(rng.choice(WORDS))}}}]}
            if rng.random() < 0.5:
                call["thinking"] = words(rng)
            messages += [call, {"role": "tool", "content": words(rng)}]
        reply = {"role": "assistant", "content": words(rng)}
        if rng.random() < 0.6:
            reply["thinking"] = words(rng)
        messages.append(reply)
    return messages


def gpt_oss_turns(text):
    """Harmony blocks '<|start|>ROLE...' ending in <|end|>, <|return|> or <|call|>; a run of blocks
    whose role is the assistant is one turn, trained after its first '<|start|>assistant'."""
    blocks = [(m.start(), m.end()) for m in re.finditer(r"<\|start\|>.*?(?:<\|end\|>|<\|return\|>|<\|call\|>)", text,
                                                        re.S)]
    assert blocks[-1][1] == len(text) and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))  # they tile the text
    turns = []
    for start, end in blocks:
        if text.startswith("<|start|>assistant", start):
            if turns and turns[-1][1] == start:
                turns[-1] = (turns[-1][0], end)
            else:
                turns.append((start + len("<|start|>assistant"), end))
    return turns


FAMILIES = {"qwen3": ("qwen3.jinja", qwen3_chat, qwen3_turns), "gpt-oss": ("gpt_oss.jinja", gpt_oss_chat, gpt_oss_turns)}


def expected_mask(tok, text, turns):
    first = np.array([s for s, _ in tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]])
    return np.array([any(s <= f < e for s, e in turns) for f in first])


@pytest.mark.parametrize("family", FAMILIES)
def test_templates_that_rewrite_earlier_turns_train_each_turn_as_the_whole_conversation_renders_it(tok_dir, family):
    """The ids are apply_chat_template's with the family's own template; the trained tokens are
    exactly each assistant turn's, found in the rendered text by the format's own delimiters;
    these conversations do defeat locating turns by prefixes (the earlier turns are rewritten)."""
    name, chat, turns_of = FAMILIES[family]
    tok = tokenizer(tok_dir, name)
    chats = ChatRenderer(TokenizerCodec(tok))
    assert chats.format(TOOLS).family == family and chats.format(None).header in ("<|im_start|>assistant\n",
                                                                                   "<|start|>assistant")
    rng = np.random.default_rng(0)
    rewritten = 0
    for n in range(40):
        messages, tools = chat(rng), TOOLS if n % 2 else None
        ids, mask = chats(check_messages(messages, f"chat {n}"), f"chat {n}", tools)
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
        assert ids.tolist() == list(tok.apply_chat_template(messages, tools=tools)["input_ids"]), n
        turns = turns_of(text)
        assert len(turns) == sum(m["role"] == "assistant" and not (family == "gpt-oss" and i and
                                                                  messages[i - 1]["role"] == "assistant")
                                 for i, m in enumerate(messages))
        assert mask.tolist() == expected_mask(tok, text, turns).tolist(), n
        try:
            ChatFormat(tok.chat_template, TokenizerCodec(tok).template_variables).assistant_spans(messages, tools, "")
        except ValueError as e:
            assert "does not render the conversation up to messages" in str(e)
            rewritten += 1
    assert rewritten >= 10  # the old way refuses these; the marks train them


def test_family_marks_need_the_assistant_branch():
    template = (TEMPLATES / "qwen3.jinja").read_text().replace('elif message.role == "tool"', 'elif message.role == "x"')
    with pytest.raises(ValueError, match="looks like a qwen3 template, but its assistant messages are not rendered"):
        ChatFormat.of(template, {})


def test_a_template_with_its_own_marks_gives_transformers_assistant_mask(tok_dir):
    """--chat-template FILE with {% generation %} marks (here around the whole turn, header too):
    the marks as written, as transformers' return_assistant_tokens_mask reads them."""
    marked = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}<|im_start|>assistant\n"
              "{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\n' }}{% else %}<|im_start|>{{ m['role'] }}\n"
              "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")
    tok = tokenizer(tok_dir)
    chats = ChatRenderer(TokenizerCodec(tok), marked)
    rng = np.random.default_rng(1)
    for n in range(10):
        messages = [{"role": ["user", "assistant"][i % 2], "content": words(rng)} for i in range(2 + n % 4)]
        ids, mask = chats(messages, f"chat {n}")
        want = tok.apply_chat_template(messages, chat_template=marked, return_assistant_tokens_mask=True)
        assert ids.tolist() == list(want["input_ids"]) and mask.astype(int).tolist() == list(want["assistant_masks"])



def test_chat_template_file_tools_and_prompt_completion_records(tmp_path, tok_dir, capsys):
    """--chat-template replaces a tokenizer's (none here); `tools` (a list, or its JSON string)
    reach the template; a text prompt/completion trains the completion and the EOS; a
    conversational one the completion's assistant turns only."""
    tok = tokenizer(tok_dir, "qwen3.jinja")
    chat = qwen3_chat(np.random.default_rng(3))
    prompt = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello how are you"},
              {"role": "user", "content": "weather in Paris?"}]
    completion = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}, {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "it is sunny"}]
    rows = [{"messages": chat, "tools": json.dumps(TOOLS)}, {"prompt": "hello cat,", "completion": " the cat sat"},
            {"prompt": prompt, "completion": completion}]
    out = str(tmp_path / "c.npy")
    main(["tokenize", write_jsonl(tmp_path / "c.jsonl", rows), "--model", tok_dir, "--output", out,
          "--chat-template", str(TEMPLATES / "qwen3.jinja")])
    assert "(3 documents, 1 of them chats, 2 prompt/completion;" in capsys.readouterr().out
    ids, starts, mask = read(out)
    docs = [(ids[a:b], mask[a:b]) for a, b in zip(starts, [*starts[1:], len(ids)])]
    text = tok.apply_chat_template(chat, tools=TOOLS, tokenize=False)
    assert "# Tools" in text and '"get_weather"' in text  # the tools reached the template
    assert docs[0][0].tolist() == list(tok(text, add_special_tokens=False)["input_ids"])
    assert docs[0][1].tolist() == expected_mask(tok, text, qwen3_turns(text)).tolist()
    enc = tok("hello cat, the cat sat", add_special_tokens=False, return_offsets_mapping=True)
    assert docs[1][0].tolist() == enc["input_ids"] + [tok.eos_token_id]
    assert docs[1][1].tolist() == [s >= len("hello cat,") for s, _ in enc["offset_mapping"]] + [True]
    whole = tok.apply_chat_template(prompt + completion, tokenize=False)
    cut = len(tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
    turns = [t for t in qwen3_turns(whole) if t[0] >= cut]
    assert len(turns) == 2 and docs[2][1].tolist() == expected_mask(tok, whole, turns).tolist()
    with pytest.raises(SystemExit, match=r"c.jsonl:1: 'prompt' and 'completion' must both be strings or both lists"):
        main(["tokenize", write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a", "completion": completion}]),
              "--model", tok_dir, "--output", out, "--chat-template", str(TEMPLATES / "qwen3.jinja")])
    with pytest.raises(ValueError, match="'tools' must be a list of JSON schemas"):
        check_tools({"name": "get_weather"}, "r")
    with pytest.raises(ValueError, match="the chat template '/no/such.jinja' never reads `messages`: it is not one"):
        tokenize(tok_dir, [write_jsonl(tmp_path / "d.jsonl", rows[:1])], out, chat_template="/no/such.jinja")
    with pytest.raises(SystemExit, match="--chat-template '.*missing.jinja': cannot read it"):
        main(["tokenize", str(tmp_path / "c.jsonl"), "--model", tok_dir, "--output", out,
              "--chat-template", str(tmp_path / "missing.jinja")])


def test_bytes_model(tmp_path):
    """--model bytes: UTF-8 bytes as ids and byte 0 after each document (as oomb corpus writes
    them, uint8); a chat needs --chat-template and is trained on its assistant characters' bytes."""
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "chatml.jinja").write_text(chatml)
    rows = [{"text": "héllo"}, {"prompt": "Q: ", "completion": "é!"},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ça"}]}]
    out = str(tmp_path / "b.npy")
    main(["tokenize", write_jsonl(tmp_path / "b.jsonl", rows), "--model", "bytes", "--output", out,
          "--chat-template", str(tmp_path / "chatml.jinja")])
    ids, starts, mask = read(out)
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nça<|im_end|>\n"
    assert ids.dtype == np.uint8 and starts.tolist() == [0, 7, 14]
    assert bytes(ids).split(b"\x00")[:2] == ["héllo".encode(), "Q: é!".encode()]
    assert bytes(ids[14:]) == chat.encode()
    trained = "ça<|im_end|>".encode()
    at = chat.encode().index(trained)
    assert mask.tolist() == [True] * 7 + [False] * 3 + [True] * 4 + [False] * at + [True] * len(trained) + \
        [False] * (len(chat.encode()) - at - len(trained))
    with pytest.raises(SystemExit, match="the tokenizer of --model 'bytes' has no chat template"):
        main(["tokenize", str(tmp_path / "b.jsonl"), "--model", "bytes", "--output", out])


@pytest.fixture
def datasets_offline(tmp_path, monkeypatch):
    """datasets with the hub out of reach and its cache under tmp_path."""
    datasets = pytest.importorskip("datasets", reason="datasets is not installed: pip install datasets")
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    return datasets


def test_datasets_through_load_dataset(tmp_path, tok_dir, datasets_offline):
    """A folder of data files (load_dataset, whole or streamed, one --split of it), a saved
    DatasetDict (--split picks one), several processes: the document file a .jsonl gives; a name
    that is neither a file nor a dataset is refused, naming both."""
    rows = [{"text": words(np.random.default_rng(i))} for i in range(30)] + \
        [{"prompt": "hello", "completion": " the cat"}, {"messages": [{"role": "user", "content": "hi"},
                                                                     {"role": "assistant", "content": "a cat"}]}]
    template = (TEMPLATES / "qwen3.jinja").read_text()
    (tmp_path / "folder").mkdir()
    write_jsonl(tmp_path / "folder" / "train.jsonl", rows)
    write_jsonl(tmp_path / "folder" / "test.jsonl", rows[:3])
    want = str(tmp_path / "want.npy")
    n = tokenize(tok_dir, [str(tmp_path / "folder" / "train.jsonl")], want, chat_template=template)
    assert np.load(sibling(want, "mask"))[-8:].any()  # the chat's answer is trained
    def columns(rows):  # None where a record lacks the field
        return datasets_offline.Dataset.from_dict({k: [r.get(k) for r in rows]
                                                   for k in ("text", "prompt", "completion", "messages")})

    datasets_offline.DatasetDict({"train": columns(rows), "test": columns(rows[:3])}).save_to_disk(tmp_path / "saved")
    for name, hub in [("folder", Hub()), ("folder", Hub(streaming=True)), ("saved", Hub(split="train"))]:
        got = str(tmp_path / "got.npy")
        n = tokenize(tok_dir, [str(tmp_path / name)], got, chat_template=template, hub=hub)
        assert n["chats"] == 1 and n["completions"] == 1, (name, hub)
        for a, b in zip(read(want), read(got)):
            assert np.array_equal(a, b), (name, hub)
    n = tokenize(tok_dir, [str(tmp_path / "folder")], str(tmp_path / "t.npy"), chat_template=template,
                 hub=Hub(split="test"))
    assert n["documents"] == 3
    with pytest.raises(ValueError, match=r"holds the splits train, test; choose one with --split \(e.g. --split train"):
        tokenize(tok_dir, [str(tmp_path / "saved")], str(tmp_path / "t.npy"))
    with pytest.raises(SystemExit, match=r"input 'no-such-org/no-such-data' is neither a local file nor a dataset "
                                         r"datasets.load_dataset can load \(split 'train'\): ConnectionError"):
        main(["tokenize", "no-such-org/no-such-data", "--model", tok_dir, "--output", str(tmp_path / "t.npy")])


def test_several_processes_tokenise_in_order(tmp_path, tok_dir):
    """--num-proc 2: the records rendered and tokenised in two spawned processes, in their order
    (the same file as one process writes); a record's error is raised with its place."""
    rows = [{"text": words(np.random.default_rng(i))} for i in range(40)] + \
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a cat"}]}]
    data = write_jsonl(tmp_path / "r.jsonl", rows)
    template = (TEMPLATES / "qwen3.jinja").read_text()
    assert tokenize(tok_dir, [data], str(tmp_path / "one.npy"), chat_template=template)["trained"] == \
        sum(len(tokenizer(tok_dir)(r["text"], add_special_tokens=False)["input_ids"]) + 1 for r in rows[:-1]) + \
        len(tokenizer(tok_dir)("<think>\n\n</think>\n\na cat<|im_end|>", add_special_tokens=False)["input_ids"])
    main(["tokenize", data, "--model", tok_dir, "--output", str(tmp_path / "two.npy"), "--chat-template",
          str(TEMPLATES / "qwen3.jinja"), "--num-proc", "2"])
    for a, b in zip(read(str(tmp_path / "one.npy")), read(str(tmp_path / "two.npy"))):
        assert np.array_equal(a, b)
