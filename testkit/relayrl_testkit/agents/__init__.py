"""Small external agents for tests: real programs that talk to the gateway's agent endpoint the
way a user's agent does (OPENAI_BASE_URL, OPENAI_API_KEY, the task as JSON on stdin)."""
