#!/usr/bin/env node
// Streams one Generate call of a kvserve model service (or gateway) and prints every event
// as one JSON line on stdout. Run `node generate.js --help` for the options.
//
// The .proto files are read at run time by @grpc/proto-loader: nothing to compile.
"use strict";

const fs = require("node:fs");
const path = require("node:path");
const crypto = require("node:crypto");
const { parseArgs } = require("node:util");

const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

// The repository's protos/ folder; KVSERVE_PROTOS points elsewhere when this file is copied out.
const PROTOS = process.env.KVSERVE_PROTOS || path.join(__dirname, "..", "..", "..", "protos");

const USAGE = `usage: node generate.js ADDRESS [PROMPT] [options]

  ADDRESS                 host:port of a model service or gateway (e.g. 127.0.0.1:50051)
  PROMPT                  the prompt text (or give --token-ids instead)

options:
  --token-ids IDS         the prompt as token ids, comma-separated (e.g. 1,4,78,79)
  --max-tokens N          tokens to generate at most (default 32)
  --temperature T         0 is greedy (default: the server's, 1.0)
  --seed N                same seed, same tokens
  --ignore-eos            keep going past EOS
  --request-id ID         name the request (default: a random id)
  --api-key KEY           sent as "authorization: Bearer KEY" metadata
  --tls-ca FILE           connect over TLS, trusting the CA certificate in FILE (PEM)
  --cancel-after N        after N tokens, cancel the request with the Cancel RPC
  -h, --help              show this help

Each event prints as one JSON line, named by the event: {"prefillDone": {...}},
{"chunk": {"tokenIds": [...], "text": "..."}}, {"finished": {"finishReason": ..., "usage": {...}}}.`;

function fail(message) {
  console.error(message);
  console.error("(node generate.js --help for the options)");
  process.exit(2);
}

// ---------------------------------------------------------------- the command line

const OPTIONS = {
  "token-ids": { type: "string" },
  "max-tokens": { type: "string", default: "32" },
  "temperature": { type: "string" },
  "seed": { type: "string" },
  "ignore-eos": { type: "boolean", default: false },
  "request-id": { type: "string" },
  "api-key": { type: "string" },
  "tls-ca": { type: "string" },
  "cancel-after": { type: "string" },
  "help": { type: "boolean", short: "h", default: false },
};

function parseCommandLine(argv) {
  let parsed;
  try {
    parsed = parseArgs({ args: argv, allowPositionals: true, options: OPTIONS });
  } catch (err) {
    fail(err.message);  // an unknown option, or a missing value (write negative ones as --temperature=-1)
  }
  const { values, positionals } = parsed;
  if (values.help) {
    console.log(USAGE);
    process.exit(0);
  }
  const [address, prompt, ...extra] = positionals;
  if (!address) fail("give the server address, e.g. 127.0.0.1:50051");
  if (extra.length) fail(`unexpected arguments: ${extra.join(" ")} (quote the prompt)`);
  if ((prompt === undefined) === (values["token-ids"] === undefined)) {
    fail("give a PROMPT or --token-ids (one of them)");
  }
  return { address, prompt, ...values };
}

function integer(text, name, min = 0) {
  const n = Number(text);
  if (!Number.isInteger(n) || n < min) fail(`${name} must be an integer >= ${min}, got ${JSON.stringify(text)}`);
  return n;
}

// The GenerateRequest, with field names in lowerCamelCase (proto-loader's keepCase: false).
function buildRequest(args) {
  const sampling = {
    maxTokens: integer(args["max-tokens"], "--max-tokens", 1),
    ignoreEos: args["ignore-eos"],
  };
  if (args.temperature !== undefined) {
    sampling.temperature = Number(args.temperature);
    if (Number.isNaN(sampling.temperature)) fail(`--temperature must be a number, got ${JSON.stringify(args.temperature)}`);
  }
  if (args.seed !== undefined) {
    // A uint64: kept as a string, as a JavaScript number is exact only up to 2^53.
    if (!/^[0-9]+$/.test(args.seed)) fail(`--seed must be an integer >= 0, got ${JSON.stringify(args.seed)}`);
    sampling.seed = args.seed;
  }

  const request = {
    // Cancel names the request by this id, so set one rather than let the server pick it.
    requestId: args["request-id"] || `node-${crypto.randomUUID()}`,
    sampling,
  };
  if (args.prompt !== undefined) {
    request.prompt = args.prompt;
  } else {
    const ids = args["token-ids"].split(/[\s,]+/).filter(Boolean).map((t) => integer(t, "a token id"));
    request.tokenIds = { ids };
  }
  return request;
}

// ---------------------------------------------------------------- gRPC

function connect(address, tlsCa) {
  const definition = protoLoader.loadSync("kvserve/inference/v1/inference.proto", {
    includeDirs: [PROTOS],  // so the import of kvserve/kvcache/v1/kvcache.proto resolves
    keepCase: false,        // lowerCamelCase field names: maxTokens, tokenIds, finishReason
    longs: String,          // uint64 fields (seed, counters) as strings
    enums: String,          // enums by name: "FINISH_REASON_ABORT"
    defaults: true,         // fields at their zero value are present (cachedTokens: 0)
    oneofs: true,           // msg.event names the member of the oneof that is set
  });
  const { Inference } = grpc.loadPackageDefinition(definition).kvserve.inference.v1;
  let credentials = grpc.credentials.createInsecure();
  if (tlsCa) {
    let ca;
    try {
      ca = fs.readFileSync(tlsCa);
    } catch (err) {
      fail(`cannot read --tls-ca: ${err.message}`);
    }
    credentials = grpc.credentials.createSsl(ca);
  }
  return new Inference(address, credentials);
}

function statusLine(err) {
  return `${grpc.status[err.code] || err.code}: ${err.details}`;
}

function main() {
  const args = parseCommandLine(process.argv.slice(2));
  const request = buildRequest(args);
  const cancelAfter = args["cancel-after"] === undefined ? null : integer(args["cancel-after"], "--cancel-after", 1);

  const client = connect(args.address, args["tls-ca"]);
  const metadata = new grpc.Metadata();
  if (args["api-key"]) metadata.add("authorization", `Bearer ${args["api-key"]}`);

  let tokens = 0;
  let cancelled = false;
  const call = client.Generate(request, metadata);

  call.on("data", (msg) => {
    // Print only the event that is set, e.g. {"chunk": {"tokenIds": [5, 9], "text": " the"}}.
    console.log(JSON.stringify({ [msg.event]: msg[msg.event] }));

    if (msg.event === "chunk") tokens += msg.chunk.tokenIds.length;
    if (cancelAfter !== null && !cancelled && tokens >= cancelAfter) {
      // Cancel by request id: the stream goes on to a `finished` event with FINISH_REASON_ABORT.
      cancelled = true;
      console.error(`cancelling ${request.requestId} after ${tokens} tokens`);
      client.Cancel({ requestId: request.requestId }, metadata, (err) => {
        if (err) console.error(`Cancel failed: ${statusLine(err)}`);
      });
    }
  });

  call.on("error", (err) => {
    // A failed stream ends with a gRPC status, e.g. "INVALID_ARGUMENT: temperature must be ...".
    console.error(statusLine(err));
    process.exitCode = 1;
    client.close();
  });

  call.on("end", () => client.close());
}

main();
