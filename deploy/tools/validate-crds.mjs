// Validate prometheus-operator objects (ServiceMonitor, PodMonitor, PrometheusRule) against the
// schemas shipped in @kubernetes-models/prometheus-operator, which kubernetes-validate lacks.
//
//   node deploy/tools/validate-crds.mjs NODE_MODULES FILE.json
//
// FILE.json holds a JSON array of objects. Prints one JSON line per object
// ({kind, name, ok, error}) and exits 1 when any object is invalid or of a kind it cannot check.
import { readFileSync } from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const [nodeModules, file] = process.argv.slice(2);
if (!nodeModules || !file) {
  console.error("usage: validate-crds.mjs NODE_MODULES FILE.json");
  process.exit(2);
}
// The package only exports ESM ("import" condition): load the model files by path.
const base = path.resolve(nodeModules, "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1");
const load = async (kind) => (await import(pathToFileURL(path.join(base, `${kind}.js`)).href))[kind];
const models = {
  ServiceMonitor: await load("ServiceMonitor"),
  PodMonitor: await load("PodMonitor"),
  PrometheusRule: await load("PrometheusRule"),
};

let failed = false;
for (const obj of JSON.parse(readFileSync(file, "utf8"))) {
  const kind = obj?.kind;
  const name = obj?.metadata?.name ?? "";
  const Model = obj?.apiVersion === "monitoring.coreos.com/v1" ? models[kind] : undefined;
  let error = null;
  if (!Model) {
    error = `no schema for ${obj?.apiVersion} ${kind}`;
  } else {
    try {
      new Model(obj).validate();
    } catch (err) {
      error = String(err?.message ?? err);
    }
  }
  failed ||= error !== null;
  console.log(JSON.stringify({ kind, name, ok: error === null, error }));
}
process.exit(failed ? 1 : 0);
