// Benchmark harness for graphile-worker (our code, calling its public API only).
//   node graphile_worker_bench.mjs setup  DSN                       run its migrations
//   node graphile_worker_bench.mjs work   DSN WORKERS [SETTING]     run a worker with a no-op task until SIGTERM
//   node graphile_worker_bench.mjs insert DSN COUNT BATCH           addJobs() COUNT no-op jobs, BATCH per call
// SETTING "fair" (the default): concurrency WORKERS, nothing else changed.
// SETTING "throughput": the preset its performance page reports its figures with
// (website/docs/performance.md, "Quick stats"): concurrentJobs WORKERS (24 there), maxPoolSize
// WORKERS + 1, a local queue of 500 (batched fetching) and completion batching with no delay.
import { makeWorkerUtils, run, runMigrations } from "graphile-worker";

const [command, connectionString, a, b] = process.argv.slice(2);

function workerOptions(workers, setting) {
  if (setting === "throughput") {
    return {
      preset: {
        worker: {
          connectionString,
          concurrentJobs: workers,
          maxPoolSize: workers + 1,
          localQueue: { size: 500 },
          completeJobBatchDelay: 0,
          failJobBatchDelay: 0,
        },
      },
    };
  }
  if (setting !== "fair") {
    console.error(`unknown setting ${setting}`);
    process.exit(2);
  }
  return { connectionString, concurrency: workers };
}

if (command === "setup") {
  await runMigrations({ connectionString });
} else if (command === "work") {
  const runner = await run({
    ...workerOptions(Number(a), b ?? "fair"),
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
