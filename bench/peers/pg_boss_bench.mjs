// Benchmark harness for pg-boss (our code, calling its public API only).
//   node pg_boss_bench.mjs setup  DSN                    start() creates its schema; createQueue("noop", notify)
//   node pg_boss_bench.mjs work   DSN WORKERS [SETTING]  work("noop") with a no-op handler until SIGTERM
//   node pg_boss_bench.mjs insert DSN COUNT BATCH        insert() COUNT no-op jobs, BATCH per call
// Both settings turn LISTEN/NOTIFY on, which takes two opt-ins (docs/api/workers.md, "Low-latency
// dispatch with LISTEN/NOTIFY"): the queue's notify (setup) and the instance's useListenNotify (work).
// SETTING "fair" (the default): localConcurrency WORKERS, fetching batches of 10.
// SETTING "throughput": the throughput options its docs name (docs/api/workers.md; they give no
// figures): batches of 100, one submitted batch per fetch, fetched continuously while they come back
// full (burstWhenBatchFull), localConcurrency WORKERS.
import { PgBoss } from "pg-boss";

const [command, connectionString, a, b] = process.argv.slice(2);
const BATCH_SIZE = { fair: 10, throughput: 100 };

if (command === "setup") {
  const boss = new PgBoss(connectionString);
  boss.on("error", (error) => console.error(error));
  await boss.start();
  await boss.createQueue("noop", { notify: true });
  await boss.stop();
} else if (command === "work") {
  const setting = b ?? "fair";
  if (!(setting in BATCH_SIZE)) {
    console.error(`unknown setting ${setting}`);
    process.exit(2);
  }
  const boss = new PgBoss({ connectionString, useListenNotify: true });
  boss.on("error", (error) => console.error(error));
  await boss.start();
  // Its documented throughput knobs: fetch batches and keep fetching while batches come back full.
  await boss.work(
    "noop",
    { localConcurrency: Number(a), batchSize: BATCH_SIZE[setting], burstWhenBatchFull: true },
    async () => {},
  );
  console.log("ready");
  const stop = () => boss.stop({ graceful: true }).then(() => process.exit(0));
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
} else if (command === "insert") {
  const boss = new PgBoss(connectionString);
  boss.on("error", (error) => console.error(error));
  await boss.start();
  console.log(`start ${(Date.now() / 1000).toFixed(6)}`);
  const count = Number(a);
  const batch = Number(b);
  for (let done = 0; done < count; done += batch) {
    const n = Math.min(batch, count - done);
    await boss.insert("noop", Array.from({ length: n }, () => ({ data: {} })));
  }
  await boss.stop();
} else {
  console.error(`unknown command ${command}`);
  process.exit(2);
}
