//! The runtime's contract, tested in memory (`testing`): the checkpoint never passes a batch a
//! sink has not made durable, order per key holds, failures are retried or stop the run, source
//! transactions stay whole within bounds, shutdown drains, bad input is recorded or stops the
//! run. Each test compares what the sinks applied with the scripted input (the independent
//! model), and was seen failing with the guard it tests removed.

use std::time::Duration;

use refract_connectors::ReadMode;
use refract_connectors::dead_letter::Stage;

use super::testing::{
    Applied, Fault, Faults, FaultySink, MemorySink, MemorySource, Pipeline, Settings, Step,
    covered, expected, history, items, let_time_pass, offsets, through,
};
use super::{RunError, TRANSACTION_BATCH_FACTOR};

/// `n` writes spread over `keys` keys, each key's values increasing.
fn puts(n: i64, keys: i64) -> Vec<Step> {
    (0..n).map(|i| Step::Put(i % keys, i)).collect()
}

/// The batch (of those `applied`) that holds the operation of the item at `offset`.
fn batch_of(applied: &[Applied], offset: u64) -> u64 {
    applied
        .iter()
        .find(|b| offsets(b).contains(&offset))
        .map(|b| b.seq)
        .unwrap_or_else(|| panic!("no batch holds offset {offset}"))
}

#[tokio::test(start_paused = true)]
async fn a_stalled_sink_holds_the_checkpoint_until_released() {
    let pipeline = Pipeline::new(Settings {
        sinks: &["a", "b"],
        ..Settings::default()
    });
    let steps = puts(10, 3);
    let (source, log) = MemorySource::new(items(&steps), 1);
    let (a, applied_a) = MemorySink::new();
    let (b, applied_b) = MemorySink::new();
    let faults = Faults::new();
    faults.plan(2, Fault::Stall);
    let sinks: Vec<(&str, Box<dyn refract_connectors::Sink>)> = vec![
        ("a", Box::new(a)),
        ("b", Box::new(FaultySink::new("b", b, faults.clone()))),
    ];
    let run = pipeline.start(source, sinks, ReadMode::UntilCaughtUp);

    run.wait_until("sink a applied every batch while b is stalled", || {
        applied_a.lock().unwrap().len() == 5 && faults.state().stalled == Some(2)
    })
    .await;
    let_time_pass().await;
    // Batch 1 is durable in both sinks; batch 2 is not in b: the checkpoint stays before it.
    let first_of_2 = *offsets(&applied_a.lock().unwrap()[1]).iter().min().unwrap();
    let durable = log.lock().unwrap().last_durable();
    assert_eq!(durable, through(first_of_2 - 1), "held before batch 2");

    faults.release();
    let summary = run.finish().await.expect("the run succeeds");
    assert_eq!(summary.checkpoint, through(steps.len() as u64));
    assert_eq!(log.lock().unwrap().last_durable(), summary.checkpoint);
    assert_eq!(history(&applied_a.lock().unwrap()), expected(&steps));
    assert_eq!(history(&applied_b.lock().unwrap()), expected(&steps));
}

#[tokio::test(start_paused = true)]
async fn order_per_key_holds_within_and_across_batches_in_every_sink() {
    let pipeline = Pipeline::new(Settings {
        sinks: &["a", "b"],
        max_events: 3,
        ..Settings::default()
    });
    // Keys written many times in one batch and across batches, in and out of transactions,
    // with deletes; b fails batches 2 and 4 for a while.
    let mut steps = puts(12, 4);
    steps.extend([Step::Begin, Step::Put(1, 100), Step::Delete(2)]);
    steps.extend(puts(5, 2).iter().map(|s| match *s {
        Step::Put(k, v) => Step::Put(k, 200 + v),
        other => other,
    }));
    steps.extend([Step::End, Step::Delete(1), Step::Put(2, 300)]);
    steps.extend(puts(9, 3));
    let (source, _log) = MemorySource::new(items(&steps), 4);
    let (a, applied_a) = MemorySink::new();
    let (b, applied_b) = MemorySink::new();
    let faults = Faults::new();
    faults.plan(2, Fault::Transient(2));
    faults.plan(4, Fault::Transient(1));
    let sinks: Vec<(&str, Box<dyn refract_connectors::Sink>)> = vec![
        ("a", Box::new(a)),
        ("b", Box::new(FaultySink::new("b", b, faults.clone()))),
    ];
    let run = pipeline.start(source, sinks, ReadMode::UntilCaughtUp);
    run.finish().await.expect("the run succeeds");

    for applied in [applied_a, applied_b] {
        let applied = applied.lock().unwrap();
        assert_eq!(history(&applied), expected(&steps));
        let seqs: Vec<u64> = applied.iter().map(|b| b.seq).collect();
        assert!(seqs.is_sorted(), "batches applied in order: {seqs:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_transient_failure_is_retried_with_backoff_and_nothing_is_lost_or_doubled() {
    let pipeline = Pipeline::new(Settings::default());
    let steps = puts(8, 3);
    let (source, log) = MemorySource::new(items(&steps), 1);
    let (sink, applied) = MemorySink::new();
    let faults = Faults::new();
    faults.plan(2, Fault::Transient(3));
    let sinks: Vec<(&str, Box<dyn refract_connectors::Sink>)> =
        vec![("a", Box::new(FaultySink::new("a", sink, faults.clone())))];
    let run = pipeline.start(source, sinks, ReadMode::UntilCaughtUp);

    run.wait_until("batch 2 failed three times", || {
        faults
            .state()
            .attempts
            .get(&2)
            .is_some_and(|a| a.len() == 3)
    })
    .await;
    // Batch 2 covers offsets 3 and 4 (two events a batch): the checkpoint waits before it.
    assert_eq!(log.lock().unwrap().last_durable(), through(2));

    let summary = run.finish().await.expect("the run succeeds");
    let attempts = faults.state().attempts[&2].clone();
    assert_eq!(attempts.len(), 4, "three failures, then success");
    let gaps: Vec<Duration> = attempts.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(
        gaps.iter().all(|g| *g >= Duration::from_millis(100)) && gaps.is_sorted(),
        "exponential backoff between attempts: {gaps:?}"
    );
    assert_eq!(summary.checkpoint, through(steps.len() as u64));
    assert_eq!(history(&applied.lock().unwrap()), expected(&steps));
}

#[tokio::test(start_paused = true)]
async fn a_permanent_failure_stops_the_run_before_the_failed_batch() {
    let pipeline = Pipeline::new(Settings::default());
    let steps = puts(10, 3);
    let (source, log) = MemorySource::new(items(&steps), 1);
    let (sink, applied) = MemorySink::new();
    let faults = Faults::new();
    faults.plan(3, Fault::Permanent);
    let sinks: Vec<(&str, Box<dyn refract_connectors::Sink>)> =
        vec![("a", Box::new(FaultySink::new("a", sink, faults.clone())))];
    let run = pipeline.start(source, sinks, ReadMode::UntilCaughtUp);

    let error = run.finish().await.expect_err("the run fails");
    assert!(
        matches!(&error, RunError::Sink(e) if !e.is_retryable()),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        "sink `a`: injected permanent failure of batch 3"
    );
    // Batches 1 and 2 (offsets 1 to 4) are durable; batch 3 is not, nor anything after it.
    assert_eq!(pipeline.committed(), through(4));
    assert_eq!(log.lock().unwrap().last_durable(), through(4));
    assert_eq!(history(&applied.lock().unwrap()), expected(&steps[..4]));
}

#[tokio::test(start_paused = true)]
async fn a_transaction_stays_in_one_batch_unless_it_outgrows_the_factor() {
    let max_events = 2;
    let pipeline = Pipeline::new(Settings {
        max_events,
        ..Settings::default()
    });
    let bound = max_events * TRANSACTION_BATCH_FACTOR;
    // After two batches of two events, a transaction of `bound` events (markers count), then
    // one of `bound + 4`.
    let small: Vec<Step> = puts(bound as i64 - 2, 3);
    let large: Vec<Step> = puts(bound as i64 + 2, 3);
    let mut steps = puts(4, 3);
    let small_at = steps.len() + 1;
    steps.push(Step::Begin);
    steps.extend(&small);
    steps.push(Step::End);
    let large_at = steps.len() + 1;
    steps.push(Step::Begin);
    steps.extend(&large);
    steps.push(Step::End);
    steps.extend(puts(3, 3));
    let (source, _log) = MemorySource::new(items(&steps), 5);
    let (sink, applied) = MemorySink::new();
    let run = pipeline.start(source, vec![("a", Box::new(sink))], ReadMode::UntilCaughtUp);
    run.finish().await.expect("the run succeeds");

    let applied = applied.lock().unwrap();
    let batches_of = |first: usize, len: usize| {
        let mut seqs: Vec<u64> = (first + 1..=first + len)
            .map(|offset| batch_of(&applied, offset as u64))
            .collect();
        seqs.dedup();
        seqs
    };
    assert_eq!(batches_of(small_at, small.len()).len(), 1, "not cut");
    let large_batches = batches_of(large_at, large.len());
    assert!(large_batches.len() > 1, "cut past the bound");
    for seq in large_batches {
        let batch = applied.iter().find(|b| b.seq == seq).unwrap();
        assert!(batch.ops.len() <= bound, "at most {bound} events a batch");
    }
    assert_eq!(history(&applied), expected(&steps));
}

#[tokio::test(start_paused = true)]
async fn shutdown_drains_what_was_read_and_flushes_buffering_sinks() {
    let pipeline = Pipeline::new(Settings {
        max_events: 3,
        ..Settings::default()
    });
    // Two full batches and a partial one, which only the drain writes.
    let steps = puts(7, 3);
    let (source, log) = MemorySource::new(items(&steps), 1);
    let (sink, applied) = MemorySink::new();
    let faults = Faults::new();
    faults.buffer(false, None);
    let sinks: Vec<(&str, Box<dyn refract_connectors::Sink>)> =
        vec![("a", Box::new(FaultySink::new("a", sink, faults.clone())))];
    let run = pipeline.start(source, sinks, ReadMode::Follow);

    run.wait_until("everything is read and two batches written", || {
        log.lock().unwrap().exhausted && faults.state().written == 2
    })
    .await;
    let_time_pass().await;
    assert_eq!(log.lock().unwrap().last_durable(), through(0), "buffered");
    assert_eq!(faults.state().flushes, 0);

    run.stop();
    let summary = run.finish().await.expect("the run drains");
    assert!(summary.stopped_by_signal);
    assert!(
        faults.state().flushes >= 1,
        "the buffering sink was flushed"
    );
    assert_eq!(summary.checkpoint, through(steps.len() as u64));
    assert_eq!(log.lock().unwrap().last_durable(), summary.checkpoint);
    assert_eq!(pipeline.committed(), summary.checkpoint);
    assert_eq!(history(&applied.lock().unwrap()), expected(&steps));
}

/// The script of the bad-input tests: good changes around each kind of bad input.
fn with_bad_input() -> Vec<Step> {
    let mut steps = puts(3, 2);
    steps.push(Step::Garbage);
    steps.extend(puts(2, 2));
    steps.push(Step::Unread);
    steps.push(Step::Put(5, 5));
    steps.push(Step::Keyless);
    steps.extend(puts(3, 2));
    steps
}

#[tokio::test(start_paused = true)]
async fn bad_input_is_dead_lettered_with_its_reason_and_position() {
    let pipeline = Pipeline::new(Settings::default());
    let steps = with_bad_input();
    let (source, _log) = MemorySource::new(items(&steps), 3);
    let (sink, applied) = MemorySink::new();
    let run = pipeline.start(source, vec![("a", Box::new(sink))], ReadMode::UntilCaughtUp);
    let summary = run.finish().await.expect("the run goes on past bad input");

    let bad: Vec<(u64, Step)> = (1..)
        .zip(steps.iter().copied())
        .filter(|(_, s)| s.is_bad())
        .collect();
    let letters = pipeline.dead_letters();
    assert_eq!(letters.len(), bad.len(), "{letters:#?}");
    assert_eq!(summary.dead_letters, bad.len() as u64);
    for ((offset, step), letter) in bad.into_iter().zip(&letters) {
        let (stage, reason) = match step {
            Step::Garbage => (Stage::Decode, format!("scripted garbage at {offset}")),
            Step::Unread => (
                Stage::Routing,
                "no projection reads table `public.other`".to_owned(),
            ),
            _ => (
                Stage::Projection,
                "projection `replica`: table `public.items`: no key: column `id` is missing or null in the row".to_owned(),
            ),
        };
        assert_eq!(letter["position"]["offset"], serde_json::json!([offset, 0]));
        assert_eq!(letter["stage"], serde_json::to_value(stage).unwrap());
        assert_eq!(letter["reason"], reason.as_str());
        assert_eq!(letter["raw"], format!("{step:?} at {offset}").as_str());
    }
    assert_eq!(summary.checkpoint, through(steps.len() as u64));
    assert_eq!(history(&applied.lock().unwrap()), expected(&steps));
}

#[tokio::test(start_paused = true)]
async fn bad_input_stops_the_run_with_everything_before_it_checkpointed() {
    let pipeline = Pipeline::new(Settings {
        on_error: "stop",
        ..Settings::default()
    });
    let steps = with_bad_input();
    let bad_at = steps.iter().position(|s| s.is_bad()).unwrap() + 1;
    let (source, log) = MemorySource::new(items(&steps), 4);
    let (sink, applied) = MemorySink::new();
    let run = pipeline.start(source, vec![("a", Box::new(sink))], ReadMode::UntilCaughtUp);

    let error = run.finish().await.expect_err("bad input stops the run");
    let RunError::BadInput {
        position,
        stage,
        reason,
    } = &error
    else {
        panic!("{error:?}")
    };
    assert_eq!(position.offset.0, bad_at as u64);
    assert_eq!(*stage, Stage::Decode);
    assert_eq!(reason, &format!("scripted garbage at {bad_at}"));
    let before = (bad_at - 1) as u64;
    assert_eq!(pipeline.committed(), through(before));
    assert_eq!(covered(&log.lock().unwrap().last_durable()), before);
    assert_eq!(
        history(&applied.lock().unwrap()),
        expected(&steps[..bad_at - 1])
    );
    assert!(pipeline.dead_letters().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_buffering_sink_holds_the_checkpoint_until_it_reports_durable() {
    let pipeline = Pipeline::new(Settings::default());
    let steps = puts(6, 2);
    let (source, log) = MemorySource::new(items(&steps), 1);
    let (sink, applied) = MemorySink::new();
    let faults = Faults::new();
    // Flushes come every 50 ms, but publish nothing until the test says so.
    faults.buffer(true, Some(Duration::from_millis(50)));
    let sinks: Vec<(&str, Box<dyn refract_connectors::Sink>)> =
        vec![("a", Box::new(FaultySink::new("a", sink, faults.clone())))];
    let run = pipeline.start(source, sinks, ReadMode::Follow);

    run.wait_until("three batches written and flushed twice", || {
        let state = faults.state();
        state.written == 3 && state.flushes >= 2
    })
    .await;
    let_time_pass().await;
    assert_eq!(log.lock().unwrap().last_durable(), through(0), "held");

    // Batch 2 (offsets 3 and 4) becomes durable: the checkpoint follows, and stops there.
    faults.report_durable(2);
    run.wait_until("the checkpoint passes batch 2", || {
        covered(&log.lock().unwrap().last_durable()) == 4
    })
    .await;
    let_time_pass().await;
    assert_eq!(log.lock().unwrap().last_durable(), through(4));

    faults.report_durable(3);
    run.wait_until("the checkpoint passes batch 3", || {
        covered(&log.lock().unwrap().last_durable()) == 6
    })
    .await;
    run.stop();
    let summary = run.finish().await.expect("the run drains");
    assert_eq!(summary.checkpoint, through(6));
    assert_eq!(history(&applied.lock().unwrap()), expected(&steps));
}

#[tokio::test]
async fn a_checkpoint_sent_before_the_checkpointer_first_runs_is_committed() {
    let pipeline = Pipeline::new(Settings::default());
    let state = super::state_path(&pipeline.config);
    std::fs::create_dir_all(&state).unwrap();
    let path = state.join(crate::checkpoint::FILE);
    let store = std::sync::Arc::new(crate::checkpoint::CheckpointStore::open(&path).unwrap());
    let (tx, rx) = tokio::sync::watch::channel(through(0));
    let (durable_tx, durable_rx) = tokio::sync::watch::channel(through(0));
    tx.send_replace(through(5));
    drop(tx);
    let last = super::checkpointing::checkpointer(store, through(0), rx, durable_tx)
        .await
        .unwrap();
    assert_eq!(last, through(5));
    assert_eq!(*durable_rx.borrow(), through(5));
    assert_eq!(pipeline.committed(), through(5));
}

/// What each key holds in the end after `batches` are applied in order (runs one after the
/// other: a replay rewrites what it rewrites).
fn final_values(batches: &[Applied]) -> std::collections::BTreeMap<String, Option<i64>> {
    history(batches)
        .into_iter()
        .map(|(key, values)| (key, *values.last().expect("a key is written")))
        .collect()
}

/// The model's end state of `steps`.
fn final_expected(steps: &[Step]) -> std::collections::BTreeMap<String, Option<i64>> {
    expected(steps)
        .into_iter()
        .map(|(key, values)| (key, *values.last().expect("a key is written")))
        .collect()
}

/// Four changes (two full batches of the test pipeline, so none is pending at the BEGIN), then
/// one transaction writing `documents` distinct rows (one document each, all emitted at its
/// end), then two more changes; the offset of the transaction's END.
fn one_large_transaction(documents: i64) -> (Vec<Step>, u64) {
    let mut steps = puts(4, 4);
    steps.push(Step::Begin);
    steps.extend((0..documents).map(|i| Step::Put(100 + i, i)));
    steps.push(Step::End);
    let end = steps.len() as u64;
    steps.extend([Step::Put(200, 1), Step::Put(201, 2)]);
    (steps, end)
}

#[tokio::test(start_paused = true)]
async fn a_transaction_s_documents_leave_in_batches_bounded_by_the_event_limit() {
    let max_events = 2;
    let pipeline = Pipeline::new(Settings {
        max_events,
        documents: true,
        ..Settings::default()
    });
    // Not stretched by `TRANSACTION_BATCH_FACTOR`, as the transaction's rows are.
    let bound = max_events;
    let documents = 40;
    let (steps, end) = one_large_transaction(documents);
    let (source, _log) = MemorySource::new(items(&steps), 5);
    let (sink, applied) = MemorySink::new();
    let run = pipeline.start(source, vec![("a", Box::new(sink))], ReadMode::UntilCaughtUp);
    let summary = run.finish().await.expect("the run succeeds");

    let applied = applied.lock().unwrap();
    let emitted: Vec<&Applied> = applied
        .iter()
        .filter(|b| offsets(b).contains(&end))
        .collect();
    let in_emission: usize = emitted
        .iter()
        .map(|b| offsets(b).iter().filter(|&&o| o == end).count())
        .sum();
    assert_eq!(in_emission, documents as usize, "every document once");
    assert!(
        emitted.len() >= documents as usize / bound,
        "the transaction's {documents} documents leave in several batches: {}",
        emitted.len()
    );
    for batch in applied.iter() {
        assert!(
            batch.ops.len() <= bound,
            "batch {} holds {} operations; at most {bound}",
            batch.seq,
            batch.ops.len()
        );
    }
    assert_eq!(history(&applied), expected(&steps));
    assert_eq!(summary.checkpoint, through(steps.len() as u64));
}

#[tokio::test(start_paused = true)]
async fn a_failure_in_the_middle_of_a_transaction_s_documents_keeps_the_checkpoint_before_it() {
    let settings = || Settings {
        max_events: 2,
        documents: true,
        ..Settings::default()
    };
    let (steps, end) = one_large_transaction(40);
    // Where a clean run cuts the documents: the batches that hold them.
    let clean = Pipeline::new(settings());
    let (source, _log) = MemorySource::new(items(&steps), 5);
    let (sink, applied) = MemorySink::new();
    let run = clean.start(source, vec![("a", Box::new(sink))], ReadMode::UntilCaughtUp);
    run.finish().await.expect("the clean run succeeds");
    let seqs: Vec<u64> = applied
        .lock()
        .unwrap()
        .iter()
        .filter(|b| offsets(b).contains(&end))
        .map(|b| b.seq)
        .collect();
    assert!(seqs.len() >= 4, "{seqs:?}");

    // The third of them fails for good: the first two are written, and their state (dirty
    // marks removed) was made durable before them.
    let pipeline = Pipeline::new(settings());
    let (source, _log) = MemorySource::new(items(&steps), 5);
    let (sink, applied) = MemorySink::new();
    let faults = Faults::new();
    faults.plan(seqs[2], Fault::Permanent);
    let sinks: Vec<(&str, Box<dyn refract_connectors::Sink>)> =
        vec![("a", Box::new(FaultySink::new("a", sink, faults.clone())))];
    let run = pipeline.start(source, sinks, ReadMode::UntilCaughtUp);
    run.finish().await.expect_err("the run fails");
    let committed = covered(&pipeline.committed());
    assert!(
        committed < end,
        "the checkpoint ({committed}) stays before the transaction's end ({end}) until all its documents are written"
    );

    // The next run resumes at the checkpoint, its state rolled back to it: every document is
    // written again.
    let (source, _log) = MemorySource::new(items(&steps).split_off(committed as usize), 5);
    let (sink, rerun) = MemorySink::new();
    let run = pipeline.start(source, vec![("a", Box::new(sink))], ReadMode::UntilCaughtUp);
    run.finish().await.expect("the rerun succeeds");
    let mut all = applied.lock().unwrap().clone();
    all.extend(rerun.lock().unwrap().iter().cloned());
    assert_eq!(final_values(&all), final_expected(&steps));
    assert_eq!(pipeline.committed(), through(steps.len() as u64));
}

/// A source that ends inside a transaction (an initial snapshot stopped or killed before its
/// END, which it does not hand out again): the documents the transaction marked are written by
/// the next run before it reads anything, even when nothing more comes; if that write fails,
/// the run after writes them.
#[tokio::test(start_paused = true)]
async fn documents_a_transaction_cut_short_marked_are_written_at_the_next_start() {
    let pipeline = Pipeline::new(Settings {
        max_events: 2,
        documents: true,
        ..Settings::default()
    });
    let mut steps = puts(4, 4);
    steps.push(Step::Begin);
    steps.extend((0..10).map(|i| Step::Put(100 + i, i)));
    let (source, _log) = MemorySource::new(items(&steps), 5);
    let (sink, first) = MemorySink::new();
    let run = pipeline.start(source, vec![("a", Box::new(sink))], ReadMode::UntilCaughtUp);
    run.finish().await.expect("the first run succeeds");
    // Its rows are read and checkpointed; the transaction never ended, so no document of it
    // was written.
    assert_eq!(pipeline.committed(), through(steps.len() as u64));
    let mut all = first.lock().unwrap().clone();
    assert_eq!(final_values(&all), final_expected(&steps[..4]));

    // The next run has nothing to read: it writes them first. Its one batch fails for good,
    // so the run after writes them again.
    let (source, _log) = MemorySource::new(Vec::new(), 5);
    let (sink, failed) = MemorySink::new();
    let faults = Faults::new();
    faults.plan(1, Fault::Permanent);
    let sinks: Vec<(&str, Box<dyn refract_connectors::Sink>)> =
        vec![("a", Box::new(FaultySink::new("a", sink, faults.clone())))];
    let run = pipeline.start(source, sinks, ReadMode::UntilCaughtUp);
    run.finish()
        .await
        .expect_err("the write of the marked documents fails");
    assert!(failed.lock().unwrap().is_empty());

    let (source, _log) = MemorySource::new(Vec::new(), 5);
    let (sink, rerun) = MemorySink::new();
    let run = pipeline.start(source, vec![("a", Box::new(sink))], ReadMode::UntilCaughtUp);
    run.finish().await.expect("the third run succeeds");
    all.extend(rerun.lock().unwrap().iter().cloned());
    assert_eq!(final_values(&all), final_expected(&steps));
    assert_eq!(pipeline.committed(), through(steps.len() as u64));
}
