// Benchmark harness for graphile-worker (our code, calling its public API only).
//   node graphile_worker_bench.mjs setup  DSN               run its migrations
//   node graphile_worker_bench.mjs work   DSN CONCURRENCY   run a worker with a no-op task until SIGTERM
//   node graphile_worker_bench.mjs insert DSN COUNT BATCH   addJobs() COUNT no-op jobs, BATCH per call
import { makeWorkerUtils, run, runMigrations } from "graphile-worker";

const [command, connectionString, a, b] = process.argv.slice(2);

if (command === "setup") {
  await runMigrations({ connectionString });
} else if (command === "work") {
  const runner = await run({
    connectionString,
    concurrency: Number(a),
    noHandleSignals: true,
    taskList: { noop: async () => {} },
  });
  console.log("ready");
  const stop = () => runner.stop().then(() => process.exit(0));
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
  await runner.promise;
} else if (command === "insert") {
  const utils = await makeWorkerUtils({ connectionString });
  await utils.withPgClient((client) => client.query("select 1"));
  console.log(`start ${(Date.now() / 1000).toFixed(6)}`);
  const count = Number(a);
  const batch = Number(b);
  for (let done = 0; done < count; done += batch) {
    const n = Math.min(batch, count - done);
    await utils.addJobs(Array.from({ length: n }, () => ({ identifier: "noop", payload: {} })));
  }
  await utils.release();
} else {
  console.error(`unknown command ${command}`);
  process.exit(2);
}
