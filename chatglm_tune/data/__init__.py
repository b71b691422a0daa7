"""Records and how they become a model's rows: `records` (reading and checking SPO records, prompt/response columns,
conversations), `dialogues` (conversations in the official tool formats), `chat_messages` (OpenAI-style
conversations with reasoning and tool calls), `xml_calls` (the agent GLMs' XML tool calls and reasoning read back
from their answers), `batches` (records encoded into training
rows and prompts with a version's prompt format and tokenizer; collators) and `tokenizing` (what every family's
tokenizer shares). Shared: it imports `runtime` and `options` only, never `models/` or an upper room."""
