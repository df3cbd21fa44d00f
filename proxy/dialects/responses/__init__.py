"""OpenAI's Responses API (`/v1/responses`, as the openai SDK's `client.responses` and
openai-agents use it); runs in the proxy."""
