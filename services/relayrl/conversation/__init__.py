"""What a conversation with the policy looks like in tokens, below the gateway, the trainer and
the tasks, which all render the same prompts: prompt rendering from the chat template
(`rendering`), the tool-call syntax (`tool_calls`) and the tools a policy may call
(`tools`: the `Tool` contract, the built-ins and the `ToolTable`)."""
