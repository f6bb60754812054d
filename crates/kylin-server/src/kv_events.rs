//! vLLM-format KV-cache events (`kylin serve --kv-events-endpoint`): what the prefix cache
//! gains and loses, published on a ZeroMQ PUB socket so that precise prefix routers (llm-d's
//! KV-cache manager, Dynamo's KV router, the Gateway API Inference Extension's prefix scorer)
//! can follow Kylin's cache as they follow vLLM's.
//!
//! The wire format is vLLM's (`vllm/distributed/kv_events.py`): each message has three frames,
//! the topic, a sequence number (8 bytes, big-endian, from 0) and a MessagePack `KVEventBatch`:
//! `[ts, [event, ...]]`, each event a tagged array as msgspec writes it:
//! `["BlockStored", [block_hash], parent_block_hash | nil, [token_ids], block_size, lora_id (nil),
//! medium (nil)]`, `["BlockRemoved", [block_hash], medium (nil)]` or `["AllBlocksCleared"]`.
//! Hashes are Kylin's chained block hashes (u64), the same in a block's `BlockStored`, its
//! children's `parent_block_hash` and its `BlockRemoved`.
//!
//! Guarantees: the engine thread never waits for the socket: it hands each step's batch to the
//! publisher task through a bounded channel, and when that is full the batch is dropped and the
//! next one begins with `AllBlocksCleared`, so a follower forgets what it can no longer trust.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use kylin_engine::kv_pool::KvEvent;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketSend, ZmqMessage};

/// Batches waiting for the socket before new ones are dropped.
const QUEUE: usize = 1024;

/// The engine thread's side of the publisher. Cheap to clone.
#[derive(Debug, Clone)]
pub struct KvEventSender {
    batches: mpsc::Sender<Vec<u8>>,
    /// A batch was dropped: the next one starts with `AllBlocksCleared`.
    dropped: Arc<AtomicBool>,
}

/// Binds a PUB socket on `endpoint` (`tcp://127.0.0.1:5557`, or `tcp://*:5557` on every
/// interface, as vLLM's default) and starts the task that publishes what the engine sends.
pub async fn start_publisher(endpoint: &str, topic: &str) -> Result<KvEventSender, String> {
    let mut socket = zeromq::PubSocket::new();
    socket
        .bind(endpoint)
        .await
        .map_err(|e| format!("cannot publish KV-cache events on --kv-events-endpoint {endpoint}: {e}"))?;
    let (batches, mut receiver) = mpsc::channel::<Vec<u8>>(QUEUE);
    let topic = Bytes::copy_from_slice(topic.as_bytes());
    tokio::spawn(async move {
        let mut sequence: u64 = 0;
        while let Some(payload) = receiver.recv().await {
            let frames = vec![topic.clone(), Bytes::copy_from_slice(&sequence.to_be_bytes()), Bytes::from(payload)];
            let Ok(message) = ZmqMessage::try_from(frames) else { continue };
            // A PUB socket with no subscriber drops the message; an error is a peer gone.
            let _ = socket.send(message).await;
            sequence += 1;
        }
    });
    Ok(KvEventSender { batches, dropped: Arc::new(AtomicBool::new(false)) })
}

impl KvEventSender {
    /// Publishes the events `drain` hands out (nothing when it hands out none), as one batch.
    pub fn publish(&self, block_size: usize, drain: impl FnOnce(&mut dyn FnMut(KvEvent<'_>))) {
        let mut batch = BatchEncoder::new(block_size);
        if self.dropped.swap(false, Ordering::AcqRel) {
            batch.push(KvEvent::Cleared);
        }
        drain(&mut |event| batch.push(event));
        if batch.count == 0 {
            return;
        }
        if self.batches.try_send(batch.finish(now())).is_err() {
            self.dropped.store(true, Ordering::Release);
        }
    }
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// A `KVEventBatch` in MessagePack, event by event.
pub struct BatchEncoder {
    events: Vec<u8>,
    count: u32,
    block_size: usize,
}

impl BatchEncoder {
    pub fn new(block_size: usize) -> Self {
        BatchEncoder { events: Vec::new(), count: 0, block_size }
    }

    pub fn push(&mut self, event: KvEvent<'_>) {
        use rmp::encode::*;
        // Writing to a Vec cannot fail.
        let out = &mut self.events;
        match event {
            KvEvent::Stored { hash, parent, tokens } => {
                let _ = write_array_len(out, 7);
                let _ = write_str(out, "BlockStored");
                let _ = write_array_len(out, 1);
                let _ = write_uint(out, hash);
                if parent == 0 {
                    let _ = write_nil(out);
                } else {
                    let _ = write_uint(out, parent);
                }
                let _ = write_array_len(out, tokens.len() as u32);
                for &t in tokens {
                    let _ = write_uint(out, u64::from(t));
                }
                let _ = write_uint(out, self.block_size as u64);
                let _ = write_nil(out);
                let _ = write_nil(out);
            }
            KvEvent::Removed { hash } => {
                let _ = write_array_len(out, 3);
                let _ = write_str(out, "BlockRemoved");
                let _ = write_array_len(out, 1);
                let _ = write_uint(out, hash);
                let _ = write_nil(out);
            }
            KvEvent::Cleared => {
                let _ = write_array_len(out, 1);
                let _ = write_str(out, "AllBlocksCleared");
            }
        }
        self.count += 1;
    }

    /// `[ts, [events]]`.
    pub fn finish(self, ts: f64) -> Vec<u8> {
        use rmp::encode::*;
        let mut out = Vec::with_capacity(self.events.len() + 16);
        let _ = write_array_len(&mut out, 2);
        let _ = write_f64(&mut out, ts);
        let _ = write_array_len(&mut out, self.count);
        out.extend_from_slice(&self.events);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_the_msgpack_arrays_vllm_decodes() {
        let mut batch = BatchEncoder::new(2);
        batch.push(KvEvent::Stored { hash: 7, parent: 0, tokens: &[1, 300] });
        batch.push(KvEvent::Removed { hash: u64::MAX });
        batch.push(KvEvent::Cleared);
        let bytes = batch.finish(1.5);
        let mut expected = vec![0x92, 0xcb];
        expected.extend_from_slice(&1.5f64.to_be_bytes());
        expected.push(0x93);
        expected.extend_from_slice(&[0x97, 0xab]);
        expected.extend_from_slice(b"BlockStored");
        expected.extend_from_slice(&[0x91, 0x07, 0xc0, 0x92, 0x01, 0xcd, 0x01, 0x2c, 0x02, 0xc0, 0xc0]);
        expected.extend_from_slice(&[0x93, 0xac]);
        expected.extend_from_slice(b"BlockRemoved");
        expected.extend_from_slice(&[0x91, 0xcf]);
        expected.extend_from_slice(&u64::MAX.to_be_bytes());
        expected.push(0xc0);
        expected.extend_from_slice(&[0x91, 0xb0]);
        expected.extend_from_slice(b"AllBlocksCleared");
        assert_eq!(bytes, expected);
    }
}
