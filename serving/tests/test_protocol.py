import logging

from serving.protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    error_response,
)


def test_request_fields_follow_openai_reference_order():
    assert list(ChatCompletionRequest.model_fields)[:4] == ["messages", "model", "frequency_penalty", "logit_bias"]


def test_unknown_fields_are_accepted_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="serving.protocol"):
        request = ChatCompletionRequest.model_validate(
            {"model": "base", "messages": [{"role": "user", "content": "hi"}], "frobnicate": 3})
    assert request.model == "base"
    assert "frobnicate" in caplog.text


def test_sampling_params_use_vllm_defaults():
    params = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).to_sampling_params()
    assert (params.temperature, params.top_p, params.max_tokens, params.stop) == (1.0, 1.0, None, [])


def test_sampling_params_take_a_single_stop_string_and_max_completion_tokens():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stop="\n", max_tokens=5,
                                    max_completion_tokens=7, temperature=0, seed=3, logprobs=True)
    params = request.to_sampling_params()
    assert (params.stop, params.max_tokens, params.temperature, params.seed, params.logprobs) == (["\n"], 7, 0.0, 3, True)


def test_message_content_parts_flatten_to_text():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]}])
    assert request.messages[0].text() == "ab"


def test_error_response_has_vllm_shape():
    body = error_response("nope", err_type="NotFoundError", status_code=404, param="model").model_dump()
    assert body == {"error": {"message": "nope", "type": "NotFoundError", "param": "model", "code": 404}}
    assert ErrorResponse.model_validate(body).error.code == 404


def test_stream_chunk_carries_prompt_token_ids_and_token_ids():
    chunk = ChatCompletionStreamResponse.model_validate({
        "model": "base", "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [5]}]})
    assert chunk.object == "chat.completion.chunk"
    assert chunk.choices[0].token_ids == [5] and chunk.prompt_token_ids == [1, 2]


def test_load_request_shape():
    assert LoadLoRAAdapterRequest(lora_name="u1-a2-v3", lora_path="/x").load_inplace is False
