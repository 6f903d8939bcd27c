"""Run by tests/server/test_tgi.py in .venv-tgi (text-generation 0.7.0 pins huggingface-hub<1.0):
the real TGI client against a server; prints one JSON document of what it got back.

usage: python tgi_client.py BASE_URL PROMPT MAX_NEW_TOKENS
"""
import json
import sys

from text_generation import Client
from text_generation.errors import BadRequestError

url, prompt, max_new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = Client(url, timeout=300)
response = client.generate(prompt, max_new_tokens=max_new_tokens, decoder_input_details=True)
stream = list(client.generate_stream(prompt, max_new_tokens=max_new_tokens))
try:
    client.generate(prompt, max_new_tokens=0)
    bad_request = None
except BadRequestError as exc:
    bad_request = str(exc)
chat = client.chat(messages=[{"role": "user", "content": prompt}], max_tokens=max_new_tokens, temperature=0)
chat_stream = list(client.chat(messages=[{"role": "user", "content": prompt}], max_tokens=max_new_tokens,
                               temperature=0, stream=True))
print(json.dumps({
    "generated_text": response.generated_text,
    "finish_reason": response.details.finish_reason.value,
    "generated_tokens": response.details.generated_tokens,
    "token_texts": [t.text for t in response.details.tokens],
    "prefill_length": len(response.details.prefill),
    "stream_texts": [r.token.text for r in stream],
    "stream_final": stream[-1].generated_text,
    "stream_details": stream[-1].details.finish_reason.value if stream[-1].details else None,
    "bad_request": bad_request,
    "chat": chat.choices[0].message.content,
    "chat_stream": "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices),
}))
