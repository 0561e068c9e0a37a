// Validates Prometheus Operator objects (ServiceMonitor, PrometheusRule) against their
// CRDs' schemas, as compiled by @kubernetes-models/prometheus-operator
// (scripts/install_k8s_tools.sh).
//
//   node validate_prometheus_operator.mjs NODE_MODULES_DIR < objects.json
//
// Prints one line per object: "ok", or "invalid: <what the schema says>".
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const modules = process.argv[2];
const models = {};
for (const object of JSON.parse(readFileSync(0, "utf8"))) {
  try {
    const kind = object.kind;
    if (!["ServiceMonitor", "PrometheusRule"].includes(kind)) {
      throw new Error(`no schema for kind ${kind}`);
    }
    if (!models[kind]) {
      const path = join(modules, `@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/${kind}.js`);
      models[kind] = (await import(pathToFileURL(path).href))[kind];
    }
    new models[kind](object).validate();
    console.log("ok");
  } catch (error) {
    console.log("invalid: " + String(error.message).replace(/\n/g, " "));
  }
}
