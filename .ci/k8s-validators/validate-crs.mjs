// Validates prometheus-operator custom resources (ServiceMonitor, PodMonitor,
// PrometheusRule, ...) with the models of @kubernetes-models/prometheus-operator: the
// same checks the package's `Model.validate()` runs (required fields, types, enums,
// duration and other patterns), compiled from the operator's Go types.
//
//   node validate-crs.mjs MODELS_DIR < documents.json
//
// MODELS_DIR is where .ci/install-k8s-validators.sh installed package.json and
// package-lock.json of this folder (it holds node_modules/). stdin is a JSON array of
// documents; stdout is one JSON object: the versions used and, per document in input
// order, {"ok": true} or {"ok": false, "error": "..."}. Exit status 0 whenever the
// answer was written, valid documents or not; 2 when it could not run.
//
// These models accept fields they do not know (a typo such as `intervall` passes):
// tests/integration/test_kubernetes.py adds the TypeScript compiler's excess-property
// check for that.

import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const PACKAGE = "@kubernetes-models/prometheus-operator";
const GROUPS = new Map([["monitoring.coreos.com/v1", "monitoring.coreos.com/v1"]]);

function fail(message) {
  process.stderr.write(`validate-crs: ${message}\n`);
  process.exit(2);
}

const dir = process.argv[2];
if (!dir) fail("usage: node validate-crs.mjs MODELS_DIR < documents.json");
const root = join(dir, "node_modules", ...PACKAGE.split("/"));
if (!existsSync(join(root, "package.json"))) fail(`${PACKAGE} is not installed under ${dir}`);
const version = JSON.parse(readFileSync(join(root, "package.json"), "utf8")).version;

let docs;
try {
  docs = JSON.parse(readFileSync(0, "utf8"));
} catch (e) {
  fail(`stdin is not JSON: ${e.message}`);
}
if (!Array.isArray(docs)) fail("stdin must be a JSON array of documents");

const models = new Map(); // "apiVersion kind" -> model class, or null when there is none

async function model(apiVersion, kind) {
  const key = `${apiVersion} ${kind}`;
  if (!models.has(key)) {
    const folder = GROUPS.get(apiVersion);
    const file = folder && /^[A-Z][A-Za-z0-9]*$/.test(kind) ? join(root, folder, `${kind}.js`) : null;
    let found = null;
    if (file && existsSync(file)) {
      const exported = (await import(pathToFileURL(file).href))[kind];
      // Every resource model carries the TypeMeta guard `is`; nested types do not.
      if (typeof exported === "function" && typeof exported.is === "function") found = exported;
    }
    models.set(key, found);
  }
  return models.get(key);
}

const results = [];
for (const doc of docs) {
  const apiVersion = doc?.apiVersion;
  const kind = doc?.kind;
  const Model = await model(String(apiVersion), String(kind));
  if (!Model) {
    results.push({ ok: false, error: `${PACKAGE} has no model for apiVersion ${apiVersion}, kind ${kind}` });
    continue;
  }
  try {
    new Model(doc).validate();
    results.push({ ok: true });
  } catch (e) {
    results.push({ ok: false, error: String(e?.message ?? e) });
  }
}

process.stdout.write(JSON.stringify({ node: process.version, package: `${PACKAGE}@${version}`, results }) + "\n");
