"""Formatters: engine RequestOutputs + the request's plan -> response objects (dicts), never bytes.

Owns the shapes of DESIGN §3 (LMI schema, tgi_compat), TGI /generate and OpenAI responses, one module per
dialect (lmi.py, tgi.py, openai.py; the Responses API's responses.py; on base.py's Formatter); answers.py picks a request's formatters off its
plan (plan.py decides) and gathers its members; bytes are the encoder's. Callers import the answers from here.
"""
from lmi_handler.protocol.formatters.answers import (
    Answer,
    StreamAnswer,
    response_body,
    stream_failure,
    stream_formatter,
)
from lmi_handler.protocol.formatters.lmi import outputs_line

__all__ = ["Answer", "StreamAnswer", "outputs_line", "response_body", "stream_failure", "stream_formatter"]
