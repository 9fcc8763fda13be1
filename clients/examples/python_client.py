"""Stream a reply, then show what the prefix cache saved. Start a server first: `kvserve up --model tiny`."""
from kvserve.clients.inference_client import Chunk, Finished, InferenceClient, KVServeError

with InferenceClient("127.0.0.1:50051", timeout=60) as client:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
    try:
        for event in client.generate(messages=messages, max_tokens=48, temperature=0.7, seed=1):
            if isinstance(event, Chunk):
                print(event.text, end="", flush=True)
            elif isinstance(event, Finished):
                print(f"\n[{event.reason}: {event.prompt_tokens} prompt tokens, {event.cached_tokens} cached]")
    except KVServeError as err:  # err.code is the gRPC status name, e.g. "INVALID_ARGUMENT"
        print(f"{err.code}: {err.message}")
