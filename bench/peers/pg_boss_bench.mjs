// Benchmark harness for pg-boss (our code, calling its public API only).
//   node pg_boss_bench.mjs setup  DSN               start() creates its schema; createQueue("noop", notify)
//   node pg_boss_bench.mjs work   DSN CONCURRENCY   work("noop") with a no-op handler until SIGTERM
//   node pg_boss_bench.mjs insert DSN COUNT BATCH   insert() COUNT no-op jobs, BATCH per call
import { PgBoss } from "pg-boss";

const [command, connectionString, a, b] = process.argv.slice(2);
const boss = new PgBoss(connectionString);
boss.on("error", (error) => console.error(error));

if (command === "setup") {
  await boss.start();
  // NOTIFY wake-ups for the queue (off by default), as its docs advise for low latency.
  await boss.createQueue("noop", { notify: true });
  await boss.stop();
} else if (command === "work") {
  await boss.start();
  // Its documented throughput knobs: fetch batches and keep fetching while batches come back full.
  await boss.work(
    "noop",
    { localConcurrency: Number(a), batchSize: 10, burstWhenBatchFull: true },
    async () => {},
  );
  console.log("ready");
  const stop = () => boss.stop({ graceful: true }).then(() => process.exit(0));
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
} else if (command === "insert") {
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
