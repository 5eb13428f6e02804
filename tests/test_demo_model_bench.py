"""bench/demo_model.py's measurements on the tiny demo model."""
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.demo_model import generate

ASK = [[{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 2 + 2?"}]]


def test_a_prefilled_reply_goes_on_from_where_the_prefix_left_it(tiny_model_dir):
    """generate(prefill=P): the model continues a reply that begins with P, and P is not returned;
    begun with the head of the model's own greedy reply, it writes the rest of that reply."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    [(whole, _)] = generate(model, tok, ASK, max_new_tokens=12)
    ids = tok(whole, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 6, whole
    head = tok.decode(ids[:3])
    [(rest, _)] = generate(model, tok, ASK, max_new_tokens=9, prefill=head)
    assert head + rest == whole
    [(other, _)] = generate(model, tok, ASK, max_new_tokens=9, prefill="~> zorblat")
    assert other != rest
