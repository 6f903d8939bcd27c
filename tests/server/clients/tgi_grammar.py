"""Run by tests/server/test_tgi.py in .venv-tgi: the real TGI client's `grammar` (json schema and regex) on
/generate and /generate_stream, and a bad regex's BadRequestError; prints one JSON document.

usage: python tgi_grammar.py BASE_URL SCHEMA_JSON
"""
import json
import sys

from text_generation import Client
from text_generation.errors import BadRequestError
from text_generation.types import Grammar, GrammarType

url, schema = sys.argv[1], json.loads(sys.argv[2])
client = Client(url, timeout=300)
ask = "Describe a fictional person as JSON with the keys name and age."
answer = client.generate(ask, max_new_tokens=60, grammar=Grammar(type=GrammarType.Json, value=schema))
stream = list(client.generate_stream(ask, max_new_tokens=60, grammar=Grammar(type=GrammarType.Json, value=schema)))
date = client.generate("When did Apollo 11 land? Date:", max_new_tokens=16,
                       grammar=Grammar(type=GrammarType.Regex, value=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))
try:
    client.generate(ask, max_new_tokens=8, grammar=Grammar(type=GrammarType.Regex, value="(unclosed"))
    bad_request = None
except BadRequestError as exc:
    bad_request = str(exc)
print(json.dumps({"json": answer.generated_text, "json_finish": answer.details.finish_reason.value,
                  "stream": "".join(r.token.text for r in stream), "stream_final": stream[-1].generated_text,
                  "date": date.generated_text, "bad_request": bad_request}))
