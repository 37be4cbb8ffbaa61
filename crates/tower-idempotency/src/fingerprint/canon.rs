//! The streaming JSON canonicaliser: one pass over the bytes, no `Value` tree.
//!
//! Canonical bytes are written in input order into one buffer; runs of input that are
//! already canonical are copied in bulk. An object whose members arrive out of order is not
//! moved: its members' spans are sorted and recorded, and the buffer is emitted through
//! those records once no object is open. So every byte is read once, written once and
//! emitted once, however deep the out-of-order nesting.

use std::{cmp::Ordering, ops::Range};

use super::pointer::{Exclusions, Step};
use super::token::{read_number, read_string, write_string};

/// serde_json's recursion limit: the 128th nested array or object is an error.
const MAX_DEPTH: u32 = 128;

/// Canonical bytes outside any object are emitted once this many are buffered.
const OUT_CHUNK: usize = 64 * 1024;

/// Marks a member name held in the arena (decoded from escapes), not in the input.
const IN_ARENA: u32 = 1 << 31;

/// Where canonical bytes go.
pub(super) trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Why a document has no canonical form.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Stop {
    /// Not one JSON document as serde_json reads one; the byte offset where reading stopped.
    Invalid(usize),
    /// Sorting its objects would move more than the reordering budget.
    OverBudget,
}

/// What a canonicalisation may do besides writing the canonical form.
#[derive(Default)]
pub(super) struct Rules<'p> {
    /// The reordering budget: at most this many bytes of out-of-order objects; none: any.
    pub(super) budget: Option<usize>,
    /// Members left out; with them, a repeated member name keeps only its last value, as a
    /// `serde_json::Value` does.
    pub(super) exclusions: Option<&'p Exclusions>,
}

/// What a canonicalisation cost, for the tests of its bounds.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Work {
    /// Bytes of out-of-order objects, as the reordering budget counts them.
    pub(super) moved: usize,
    /// The most bytes held at once in buffers and records (capacities).
    pub(super) peak_held: usize,
}

/// An open object's member: where its canonical span starts, and its decoded name. Kept
/// members' spans are contiguous, one comma apart: each ends where the next starts, less one,
/// and the last where the object's inside ends; not recording it saves a quarter.
#[derive(Clone, Copy)]
struct Member {
    start: u32,
    name: u32,
    name_len: u32,
}

/// A member's place in the sorted order: its name's [prefix](prefix_of) in two halves, then
/// its index in the object. Three `u32`s, not `(u64, u32)`: 12 bytes a member, not 16.
type SortKey = [u32; 3];

/// An object whose members are emitted in another order than they were written.
struct Reorder {
    start: u32,
    end: u32,
    spans: Range<usize>,
}

/// Canonicalises `input` into `sink`.
pub(super) fn canonicalise<S: Sink>(
    input: &[u8],
    rules: Rules<'_>,
    sink: &mut S,
) -> Result<Work, Stop> {
    if input.len() > (u32::MAX / 8) as usize {
        // Offsets are 32-bit; such a body is hashed as its bytes.
        return Err(Stop::OverBudget);
    }
    let mut canon = Canon {
        input,
        pos: 0,
        run: 0,
        out: Vec::with_capacity(input.len().min(OUT_CHUNK * 2)),
        members: Vec::new(),
        arena: Vec::new(),
        reorders: Vec::new(),
        spans: Vec::new(),
        decoded: Vec::new(),
        keys: Vec::new(),
        open_objects: 0,
        rules,
        live: Vec::new(),
        work: Work::default(),
        sink,
    };
    if let Some(exclusions) = canon.rules.exclusions {
        canon.live.extend(0..exclusions.len());
    }
    let root = 0..canon.live.len();
    canon.skip_whitespace();
    canon.value(MAX_DEPTH, 0, root)?;
    canon.skip_whitespace();
    if canon.pos != input.len() {
        return Err(Stop::Invalid(canon.pos));
    }
    canon.drain();
    Ok(canon.work)
}

struct Canon<'a, 'p, 's, S> {
    input: &'a [u8],
    pos: usize,
    /// `input[run..pos]` is canonical and not yet copied: the output is `out` then it.
    run: usize,
    out: Vec<u8>,
    /// The members of every open object, innermost last.
    members: Vec<Member>,
    /// Decoded names of open objects' members that had escapes.
    arena: Vec<u8>,
    reorders: Vec<Reorder>,
    /// Sorted member spans of the reordered objects.
    spans: Vec<(u32, u32)>,
    decoded: Vec<u8>,
    /// The closing object's members in emission order, as [`SortKey`]s: scratch.
    keys: Vec<SortKey>,
    open_objects: usize,
    rules: Rules<'p>,
    /// Indices of pointers matching the path so far, one range per open container.
    live: Vec<u32>,
    work: Work,
    sink: &'s mut S,
}

impl<S: Sink> Canon<'_, '_, '_, S> {
    fn invalid<T>(&self) -> Result<T, Stop> {
        Err(Stop::Invalid(self.pos))
    }

    /// The output offset of `pos`.
    fn out_pos(&self) -> usize {
        self.out.len() + (self.pos - self.run)
    }

    /// Copies the pending canonical run up to `upto`, and starts the next one at `resume`.
    fn cut(&mut self, upto: usize, resume: usize) {
        self.out.extend_from_slice(&self.input[self.run..upto]);
        self.run = resume;
    }

    fn skip_whitespace(&mut self) {
        let start = self.pos;
        while matches!(self.input.get(self.pos), Some(b' ' | b'\n' | b'\t' | b'\r')) {
            self.pos += 1;
        }
        if self.pos != start {
            self.cut(start, self.pos);
        }
    }

    fn value(&mut self, depth_left: u32, path: usize, live: Range<usize>) -> Result<(), Stop> {
        match self.input.get(self.pos) {
            Some(b'{') => self.object(depth_left - 1, path, live),
            Some(b'[') => self.array(depth_left - 1, path, live),
            Some(b'"') => self.string().map(drop),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            _ => self.invalid(),
        }
    }

    fn literal(&mut self, word: &[u8]) -> Result<(), Stop> {
        if !self.input[self.pos..].starts_with(word) {
            return self.invalid();
        }
        self.pos += word.len();
        Ok(())
    }

    #[inline]
    fn number(&mut self) -> Result<(), Stop> {
        let start = self.pos;
        let Some(number) = read_number(self.input, start) else {
            return self.invalid();
        };
        let token = &self.input[start..number.end];
        if !number.is_canonical(token) {
            self.cut(start, number.end);
            if number.write_canonical(token, &mut self.out).is_none() {
                return self.invalid();
            }
        }
        self.pos = number.end;
        Ok(())
    }

    /// Reads a string; returns its decoded bytes' place: in the input (`start`, `len`), or
    /// in `self.decoded` (`IN_ARENA`) when it had escapes.
    fn string(&mut self) -> Result<(u32, u32), Stop> {
        let start = self.pos;
        let Some(end) = read_string(self.input, start, &mut self.decoded) else {
            return self.invalid();
        };
        self.pos = end.end;
        if !end.escaped {
            return Ok(((start + 1) as u32, (end.end - start - 2) as u32));
        }
        self.cut(start, end.end);
        write_string(&mut self.out, &self.decoded);
        Ok((IN_ARENA, self.decoded.len() as u32))
    }

    fn array(&mut self, depth_left: u32, path: usize, live: Range<usize>) -> Result<(), Stop> {
        if depth_left == 0 {
            return self.invalid();
        }
        self.pos += 1;
        self.skip_whitespace();
        if self.input.get(self.pos) == Some(&b']') {
            self.pos += 1;
            return Ok(());
        }
        for index in 0.. {
            let child = self.enter_element(path, live.clone(), index);
            if child.is_empty() && matches!(self.input.get(self.pos), Some(b'-' | b'0'..=b'9')) {
                // The common element, read without the dispatch of `value`; a run of short
                // integers, already canonical, is skipped in one tight loop.
                self.pos = integer_run(self.input, self.pos);
                self.number()?;
            } else {
                self.value(depth_left, path + 1, child.clone())?;
            }
            self.live.truncate(child.start);
            if self.open_objects == 0 && self.out_pos() >= OUT_CHUNK {
                self.drain();
            }
            self.skip_whitespace();
            match self.input.get(self.pos) {
                Some(b',') => {
                    self.pos += 1;
                    self.skip_whitespace();
                }
                Some(b']') => break,
                _ => return self.invalid(),
            }
        }
        self.pos += 1;
        Ok(())
    }

    fn enter_element(&mut self, path: usize, live: Range<usize>, index: usize) -> Range<usize> {
        let start = self.live.len();
        if let Some(exclusions) = self.rules.exclusions {
            for i in live {
                let p = self.live[i];
                if exclusions.goes_into_element(p, path, index) {
                    self.live.push(p);
                }
            }
        }
        start..self.live.len()
    }

    fn object(&mut self, depth_left: u32, path: usize, live: Range<usize>) -> Result<(), Stop> {
        if depth_left == 0 {
            return self.invalid();
        }
        let start = self.out_pos();
        self.pos += 1;
        self.skip_whitespace();
        if self.input.get(self.pos) == Some(&b'}') {
            self.pos += 1;
            return Ok(());
        }
        if self.open_objects == 0 {
            // What the outermost object's canonical form needs, without doubling's slack.
            self.out.reserve_exact(self.input.len() - self.pos);
        }
        self.open_objects += 1;
        let (first, arena) = (self.members.len(), self.arena.len());
        loop {
            self.member(depth_left, path, live.clone(), first)?;
            self.skip_whitespace();
            match self.input.get(self.pos) {
                Some(b',') => {
                    // Commas are written between kept members, not copied.
                    self.cut(self.pos, self.pos + 1);
                    self.pos += 1;
                    self.skip_whitespace();
                }
                Some(b'}') => break,
                _ => return self.invalid(),
            }
        }
        let inner_end = self.out_pos();
        self.pos += 1;
        self.close_object(start, inner_end, first)?;
        self.members.truncate(first);
        self.arena.truncate(arena);
        self.open_objects -= 1;
        Ok(())
    }

    fn member(
        &mut self,
        depth_left: u32,
        path: usize,
        live: Range<usize>,
        first: usize,
    ) -> Result<(), Stop> {
        if self.input.get(self.pos) != Some(&b'"') {
            return self.invalid();
        }
        self.cut(self.pos, self.pos);
        let comma = self.members.len() > first;
        if comma {
            self.out.push(b',');
        }
        let start = self.out.len();
        let (mut name, name_len) = self.string()?;
        if name == IN_ARENA {
            name |= self.arena.len() as u32;
            self.arena.extend_from_slice(&self.decoded);
        }
        let (excluded, child) = self.enter_member(path, live, name, name_len);
        self.skip_whitespace();
        if self.input.get(self.pos) != Some(&b':') {
            return self.invalid();
        }
        self.pos += 1;
        self.skip_whitespace();
        let (reorders, spans) = (self.reorders.len(), self.spans.len());
        self.value(depth_left, path + 1, child.clone())?;
        self.live.truncate(child.start);
        if excluded {
            self.cut(self.pos, self.pos);
            self.out.truncate(start - usize::from(comma));
            self.reorders.truncate(reorders);
            self.spans.truncate(spans);
        } else {
            grow_gently(&mut self.members);
            self.members.push(Member {
                start: start as u32,
                name,
                name_len,
            });
        }
        Ok(())
    }

    fn enter_member(
        &mut self,
        path: usize,
        live: Range<usize>,
        name: u32,
        len: u32,
    ) -> (bool, Range<usize>) {
        let start = self.live.len();
        let mut excluded = false;
        if let Some(exclusions) = self.rules.exclusions {
            let name = name_bytes(self.input, &self.arena, name, len);
            for i in live {
                let p = self.live[i];
                match exclusions.at_member(p, path, name) {
                    Step::Ends => excluded = true,
                    Step::GoesOn => self.live.push(p),
                    Step::Elsewhere => {}
                }
            }
        }
        (excluded, start..self.live.len())
    }

    /// Records the order in which a closed object's members are emitted, if it is not the
    /// order they were written in.
    fn close_object(&mut self, start: usize, inner_end: usize, first: usize) -> Result<(), Stop> {
        let deduplicate = self.rules.exclusions.is_some();
        let input = self.input;
        let arena = &self.arena;
        let names = |m: &Member| name_bytes(input, arena, m.name, m.name_len);
        let in_order = self.members[first..].windows(2).all(|w| {
            match compare_names(names(&w[0]), names(&w[1])) {
                Ordering::Less => true,
                Ordering::Equal => !deduplicate,
                Ordering::Greater => false,
            }
        });
        if in_order {
            self.note_held();
            return Ok(());
        }
        let end = inner_end + 1;
        if let Some(budget) = self.rules.budget {
            self.work.moved += end - start;
            if self.work.moved > budget {
                return Err(Stop::OverBudget);
            }
        }
        self.sort_members(first);
        self.note_held();
        let arena = &self.arena;
        let names = |m: &Member| name_bytes(input, arena, m.name, m.name_len);
        let from = self.spans.len();
        let members = &self.members[first..];
        for (i, &[high, low, at]) in self.keys.iter().enumerate() {
            let m = &members[at as usize];
            let last_of_name = self.keys.get(i + 1).is_none_or(|&[h, l, next]| {
                (h, l) != (high, low) || names(&members[next as usize]) != names(m)
            });
            if !deduplicate || last_of_name {
                grow_gently(&mut self.spans);
                let end = members
                    .get(at as usize + 1)
                    .map_or(inner_end as u32, |n| n.start - 1);
                self.spans.push((m.start, end));
            }
        }
        self.reorders.push(Reorder {
            start: start as u32,
            end: end as u32,
            spans: from..self.spans.len(),
        });
        Ok(())
    }

    /// Fills `keys` with the open object's members in emission order: by name, members of
    /// one name by position. Sorting fixed-size records of integers touches no name, except
    /// among names that share their first eight bytes.
    fn sort_members(&mut self, first: usize) {
        let (input, arena) = (self.input, &self.arena);
        let names = |m: &Member| name_bytes(input, arena, m.name, m.name_len);
        let members = &self.members[first..];
        self.keys.clear();
        self.keys.reserve_exact(members.len());
        let keys = members.iter().enumerate();
        self.keys.extend(keys.map(|(i, m)| {
            let prefix = prefix_of(names(m));
            [(prefix >> 32) as u32, prefix as u32, i as u32]
        }));
        self.keys.sort_unstable();
        for run in self.keys.chunk_by_mut(|a, b| a[..2] == b[..2]) {
            if run.len() > 1 {
                // Stable, and the run is in positions' order already.
                run.sort_by(|a, b| {
                    names(&members[a[2] as usize]).cmp(names(&members[b[2] as usize]))
                });
            }
        }
    }

    fn note_held(&mut self) {
        let held = self.out.capacity()
            + self.members.capacity() * size_of::<Member>()
            + self.arena.capacity()
            + self.reorders.capacity() * size_of::<Reorder>()
            + self.spans.capacity() * size_of::<(u32, u32)>()
            + self.decoded.capacity()
            + self.keys.capacity() * size_of::<SortKey>();
        self.work.peak_held = self.work.peak_held.max(held);
    }

    /// Emits everything written so far; no object is open.
    fn drain(&mut self) {
        self.note_held();
        if self.out.is_empty() {
            self.sink.put(&self.input[self.run..self.pos]);
            self.run = self.pos;
            return;
        }
        self.cut(self.pos, self.pos);
        self.reorders.sort_unstable_by_key(|r| r.start);
        self.emit(0, self.out.len());
        self.out.clear();
        self.reorders.clear();
        self.spans.clear();
    }

    /// Emits `out[from..to]`, each reordered object in it in its members' sorted order.
    fn emit(&mut self, mut from: usize, to: usize) {
        let mut next = self.reorders.partition_point(|r| (r.start as usize) < from);
        while let Some(reorder) = self.reorders.get(next).filter(|r| (r.start as usize) < to) {
            let (start, end, spans) = (
                reorder.start as usize,
                reorder.end as usize,
                reorder.spans.clone(),
            );
            self.sink.put(&self.out[from..start]);
            self.sink.put(b"{");
            for i in spans.clone() {
                if i > spans.start {
                    self.sink.put(b",");
                }
                let (a, b) = self.spans[i];
                self.emit(a as usize, b as usize);
            }
            self.sink.put(b"}");
            from = end;
            next = self.reorders.partition_point(|r| (r.start as usize) < from);
        }
        self.sink.put(&self.out[from..to]);
    }
}

/// Byte order of two names, decided by their first eight bytes where they differ there: an
/// integer comparison instead of a call to compare slices, for objects of many members.
fn compare_names(a: &[u8], b: &[u8]) -> Ordering {
    // Zero padding makes `a` and `a\0` tie here; the full comparison then orders them.
    prefix_of(a).cmp(&prefix_of(b)).then_with(|| a.cmp(b))
}

/// A name's first eight bytes as a big-endian integer, zero-padded: ordered as the names are,
/// except that names sharing those bytes tie.
fn prefix_of(name: &[u8]) -> u64 {
    match name.first_chunk::<8>() {
        Some(bytes) => u64::from_be_bytes(*bytes),
        // A fixed-size load above; short names byte by byte, not through `memcpy`.
        None => name
            .iter()
            .enumerate()
            .fold(0, |key, (i, &b)| key | u64::from(b) << (56 - 8 * i)),
    }
}

/// A member's decoded name: in the input, or in the arena.
fn name_bytes<'b>(input: &'b [u8], arena: &'b [u8], name: u32, len: u32) -> &'b [u8] {
    let (source, at) = if name & IN_ARENA != 0 {
        (arena, name & !IN_ARENA)
    } else {
        (input, name)
    };
    &source[at as usize..(at + len) as usize]
}

/// Skips a run of integers of at most 18 digits separated by single commas (`1,-22,333,`),
/// each its own canonical form, up to the start of the run's last number, which the caller
/// reads as any number: what follows it decides whether it is one.
fn integer_run(input: &[u8], mut at: usize) -> usize {
    loop {
        let start = at;
        let mut i = at + usize::from(input.get(at) == Some(&b'-'));
        let first = i;
        match input.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                i += 1;
                while input.get(i).is_some_and(u8::is_ascii_digit) {
                    i += 1;
                }
            }
            _ => return start,
        }
        let negative_zero = first != start && i == first + 1 && input[first] == b'0';
        if i - first > 18 || negative_zero || input.get(i) != Some(&b',') {
            return start;
        }
        if !matches!(input.get(i + 1), Some(b'-' | b'0'..=b'9')) {
            return start;
        }
        at = i + 1;
    }
}

/// Makes room for one more element by a quarter more, not double: records are held until
/// their object closes, and doubling would hold up to twice what they need.
fn grow_gently<T>(records: &mut Vec<T>) {
    if records.len() == records.capacity() {
        records.reserve_exact(records.len() / 4 + 64);
    }
}
