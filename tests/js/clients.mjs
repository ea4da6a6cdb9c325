// The JavaScript clients a user reaches for, against a running kvserve: the openai npm package and the Vercel AI
// SDK (@ai-sdk/openai-compatible), each running the whole tool loop on the instruct model: the model calls
// get_weather, the tool runs, its result goes back, and the final step (tool_choice "none") answers in text.
// Usage: node clients.mjs BASE_URL MODEL   (BASE_URL ends in /v1); prints one JSON object with what each got.
import OpenAI from "openai";
import { generateText, stepCountIs, tool } from "ai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { z } from "zod";

const [baseURL, model] = process.argv.slice(2);
const SYSTEM = "You are a helpful assistant. Once a tool result is given, answer the user in one sentence.";
const QUESTION = "What's the weather like in Paris today?";
const RESULT = { temperature: 18, sky: "sunny" };
const ran = [];

async function openaiLoop() {
  const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0 });
  const tools = [
    {
      type: "function",
      function: {
        name: "get_weather",
        description: "Get the current weather in a city",
        parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
      },
    },
  ];
  const messages = [
    { role: "system", content: SYSTEM },
    { role: "user", content: QUESTION },
  ];
  const first = await client.chat.completions.create({ model, messages, tools, temperature: 0, max_tokens: 100 });
  const choice = first.choices[0];
  const calls = choice.message.tool_calls ?? [];
  messages.push(choice.message);
  for (const call of calls) {
    messages.push({ role: "tool", tool_call_id: call.id, content: JSON.stringify(RESULT) });
  }
  const final = await client.chat.completions.create({
    model, messages, tools, tool_choice: "none", temperature: 0, max_tokens: 100,
  });
  return {
    finish_reason: choice.finish_reason,
    calls: calls.map((c) => ({ name: c.function.name, arguments: JSON.parse(c.function.arguments) })),
    final_text: final.choices[0].message.content,
    final_calls: final.choices[0].message.tool_calls ?? [],
  };
}

async function aiSdkLoop() {
  const provider = createOpenAICompatible({ name: "kvserve", baseURL, apiKey: "unused" });
  const result = await generateText({
    model: provider(model),
    system: SYSTEM,
    prompt: QUESTION,
    temperature: 0,
    maxOutputTokens: 100,
    maxRetries: 0,
    tools: {
      get_weather: tool({
        description: "Get the current weather in a city",
        inputSchema: z.object({ city: z.string() }),
        execute: async ({ city }) => {
          ran.push(city);
          return RESULT;
        },
      }),
    },
    stopWhen: stepCountIs(2),
    prepareStep: ({ stepNumber }) => (stepNumber > 0 ? { toolChoice: "none" } : {}),
  });
  const first = result.steps[0];
  return {
    steps: result.steps.length,
    finish_reason: first.finishReason,
    calls: first.toolCalls.map((c) => ({ name: c.toolName, arguments: c.input })),
    tool_ran_for: ran,
    final_text: result.text,
  };
}

console.log(JSON.stringify({ openai: await openaiLoop(), ai_sdk: await aiSdkLoop() }));
