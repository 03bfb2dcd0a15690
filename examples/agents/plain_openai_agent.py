"""The smallest agent: the plain `openai` client, two chat turns, then it exits. Nothing in it
knows about relayrl; it does not close its session. Its exit ends the episode, and the
reward-service scores what the policy generated.

    relayrl up --agent "python examples/agents/plain_openai_agent.py"
"""

import json
import sys

from openai import OpenAI

task = json.loads(sys.stdin.readline())  # {"messages": [...], ...}
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
model = client.models.list().data[0].id
messages = list(task["messages"])
reply = client.chat.completions.create(model=model, messages=messages, max_tokens=64)
messages.append({"role": "assistant", "content": reply.choices[0].message.content})
messages.append({"role": "user", "content": "Check it, then give only the final number."})
reply = client.chat.completions.create(model=model, messages=messages, max_tokens=64)
print(reply.choices[0].message.content)
