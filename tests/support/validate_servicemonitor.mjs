// Validates ServiceMonitor objects against the Prometheus Operator CRD's schema, as
// compiled by @kubernetes-models/prometheus-operator (scripts/install_k8s_tools.sh).
//
//   node validate_servicemonitor.mjs NODE_MODULES_DIR < objects.json
//
// Prints one line per object: "ok", or "invalid: <what the schema says>".
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const modules = process.argv[2];
const model = join(modules, "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor.js");
const { ServiceMonitor } = await import(pathToFileURL(model).href);
for (const object of JSON.parse(readFileSync(0, "utf8"))) {
  try {
    new ServiceMonitor(object).validate();
    console.log("ok");
  } catch (error) {
    console.log("invalid: " + String(error.message).replace(/\n/g, " "));
  }
}
